# Two commands do everything: `make run` (set up, pull the default model, run the main job)
# and `make test`. Both create and reuse ./.venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup gpu-setup run test lint bench clean

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

# On a GPU machine only (never part of `make test`): the CUDA VMM bindings and Triton, from the
# `gpu` extra (`make gpu-setup CUDA_EXTRA=cuda12` on a CUDA 12 driver: cuda-python 13.x needs an
# R580+ driver). FLASH_ATTN=1 also builds flash-attn from source: it needs nvcc, torch importable
# in the build (--no-build-isolation) and a long compile. Checks that a GPU is there first.
CUDA_EXTRA ?= gpu
gpu-setup: $(STAMP)
	@$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-setup: this torch sees no CUDA GPU')"
	$(BIN)/pip install --quiet -e '.[$(CUDA_EXTRA)]'
	if [ "$(FLASH_ATTN)" = "1" ]; then $(BIN)/pip install --no-build-isolation 'flash-attn>=2.6'; fi

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
