# Two commands do everything: `make run` (set up, pull the default model, run the main job)
# and `make test`. Both create and reuse ./.venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# CPU machines take the CPU build of torch that lies on disk; never the multi-GB CUDA build.
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install --quiet torch; \
	else \
		$(BIN)/pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/pip install --quiet -e '.[dev,bench]'
	touch $(STAMP)

setup: $(STAMP)

KV_MODE ?= vattention

run: $(STAMP)
	$(BIN)/vmkv pull
	$(BIN)/vmkv serve --kv-mode $(KV_MODE) --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/vmkv bench

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
