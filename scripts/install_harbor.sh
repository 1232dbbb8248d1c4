#!/usr/bin/env bash
# Harbor (PyPI `harbor`) in its own virtual environment, .venv-harbor: its ATIF models and
# validator check relayrl's ATIF export in the tests (tests/trajectory/test_atif.py). Harbor needs
# Python >= 3.12 while relayrl supports 3.11, so it gets a venv of its own (the pattern in
# scripts/lib.sh); it holds harbor alone, since relayrl never imports it.
#   RELAYRL_HARBOR_VENV     venv directory (default: <repo>/.venv-harbor)
#   RELAYRL_HARBOR_VERSION  harbor version (default: 0.26.0)
#   PYTHON                  interpreter to build it from (default: Python 3.12)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
VENV="${RELAYRL_HARBOR_VENV:-$ROOT/.venv-harbor}"
SPEC="harbor==${RELAYRL_HARBOR_VERSION:-0.26.0}"
STAMP=.relayrl-harbor-ok
if extra_venv_ready "$VENV" "$STAMP" "$SPEC"; then
  echo "$SPEC already installed in $VENV"
  exit 0
fi
extra_venv_create "$VENV" "${PYTHON:-$(python_for 3.12)}"
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" "$SPEC"
"$VENV/bin/python" -c "from harbor.models.trajectories import Trajectory"
extra_venv_done "$VENV" "$STAMP" "$SPEC"
