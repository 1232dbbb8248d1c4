#!/usr/bin/env bash
# NeMo Gym (PyPI `nemo-gym`) in its own virtual environment, .venv-nemo-gym: NeMo Gym needs
# Python >= 3.12 (its newest releases >= 3.13.14) while relayrl supports 3.11, and pins openai
# below relayrl's, so it gets a venv of its own (the pattern in scripts/lib.sh). It holds nemo-gym
# alone: relayrl never imports it, it starts NeMo Gym's servers with this venv's python and talks
# to them over HTTP (relayrl.envs.nemo_gym, tests/envs/test_nemo_gym.py).
#   RELAYRL_NEMO_GYM_VENV     venv directory (default: <repo>/.venv-nemo-gym)
#   RELAYRL_NEMO_GYM_VERSION  nemo-gym version (default: 0.4.0, the newest for Python < 3.13.14)
#   PYTHON                    interpreter to build it from (default: Python 3.12)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
VENV="${RELAYRL_NEMO_GYM_VENV:-$ROOT/.venv-nemo-gym}"
SPEC="nemo-gym==${RELAYRL_NEMO_GYM_VERSION:-0.4.0}"
STAMP=.relayrl-nemo-gym-ok
if extra_venv_ready "$VENV" "$STAMP" "$SPEC"; then
  echo "$SPEC already installed in $VENV"
  exit 0
fi
extra_venv_create "$VENV" "${PYTHON:-$(python_for 3.12)}"
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" "$SPEC"
"$VENV/bin/python" -c "import nemo_gym.base_resources_server, nemo_gym.openai_utils"
extra_venv_done "$VENV" "$STAMP" "$SPEC"
