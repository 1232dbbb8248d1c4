#!/usr/bin/env bash
# Make the separate virtual environment that runs AReaL's OpenAI proxy for
# benchmarks/bench_vs_areal.py (an optional comparison; nothing of relayrl needs it).
#
# areal==1.0.4 pins torch<2.11 and lists ~80 requirements (CUDA kernels, ray, wandb, litellm[proxy],
# openhands, ...); resolving them pulls GBs of CUDA packages. Its proxy server
# (areal.experimental.openai.proxy.proxy_rollout_server) imports far fewer, so AReaL goes in with
# --no-deps, on the CPU build of torch, plus exactly the packages that module imports (found by
# importing it until nothing was missing). Idempotent: does nothing when the venv imports it.
#
#   RELAYRL_AREAL_VENV  venv directory (default: <repo>/.venv-areal)
#   PYTHON              interpreter to build the venv from (default: python3.11, else python3)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RELAYRL_AREAL_VENV:-$ROOT/.venv-areal}"
AREAL_VERSION="1.0.4"
TORCH_VERSION="2.13.0"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
CHECK="import areal.experimental.openai.proxy.proxy_rollout_server"

installed_ok() {
  [ -x "$VENV/bin/python" ] && [ -f "$VENV/.relayrl-areal-ok" ] || return 1
  LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "$CHECK" >/dev/null 2>&1
}

if installed_ok; then
  echo "areal==$AREAL_VERSION already installed in $VENV"
  exit 0
fi

start=$(date +%s)
echo "creating $VENV with $PY"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# The CPU build of torch first: areal's own pin (torch<2.11) resolves to a CUDA build.
if ! "${PIP[@]}" install "torch==${TORCH_VERSION}+cpu"; then
  "${PIP[@]}" install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
fi
"${PIP[@]}" install --no-deps "areal==${AREAL_VERSION}"

# What the proxy server imports, at areal's own pins where it has them. litellm: the proxy imports
# litellm.llms.anthropic.experimental_pass_through, which litellm moved after 1.81 (areal asks for
# >=1.81.3). uvloop is areal's (uvicorn picks it up); httptools is not among areal's requirements,
# so uvicorn serves AReaL's proxy with h11, as a plain `pip install areal` would.
"${PIP[@]}" install \
  "transformers>=5.0.0,<=5.3.0" "litellm==1.81.16" "omegaconf==2.4.0.dev2" "hydra-core==1.4.0.dev1" \
  "fastapi>=0.115.12" uvicorn "uvloop>=0.21.0" "aiohttp>=3.13.3,<4" "httpx>=0.28.1" openai \
  anthropic pydantic orjson numpy psutil pyyaml colorlog "tenacity>=8.2.0" flask torchdata lark \
  ray numba pillow einops aiofiles

LITELLM_LOCAL_MODEL_COST_MAP=True "$VENV/bin/python" -c "$CHECK; import areal; print('areal', areal.__version__)"
touch "$VENV/.relayrl-areal-ok"
echo "installed areal==$AREAL_VERSION (proxy only) into $VENV in $(( $(date +%s) - start ))s"
