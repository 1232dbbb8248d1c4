#!/usr/bin/env bash
# Harbor (PyPI `harbor`) in its own virtual environment, .venv-harbor: its ATIF models and
# validator check relayrl's ATIF export in the tests. Harbor needs Python >= 3.12 while relayrl
# supports 3.11, so it cannot share relayrl's environment; relayrl never imports it. The venv
# holds harbor alone (nothing inherited from the environment relayrl was installed into).
# Idempotent: does nothing when the wanted version is already there.
#   RELAYRL_HARBOR_VENV     venv directory (default: <repo>/.venv-harbor)
#   RELAYRL_HARBOR_VERSION  harbor version (default: 0.26.0)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RELAYRL_HARBOR_VENV:-$ROOT/.venv-harbor}"
VERSION="${RELAYRL_HARBOR_VERSION:-0.26.0}"
# The first interpreter that runs and is 3.12+ (a pyenv shim can exist and still fail)
PY=""
for cand in ${PYTHON312:-} python3.12 python3.13 /root/.pyenv/versions/3.12.*/bin/python3 \
            /root/.pyenv/versions/3.13.*/bin/python3; do
  if "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    PY="$cand"
    break
  fi
done
if [ -z "$PY" ]; then
  echo "install_harbor.sh: needs Python 3.12 or newer (set PYTHON312 to one)" >&2
  exit 1
fi
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('harbor') != '$VERSION')" 2>/dev/null; then
  echo "harbor==$VERSION already installed in $VENV"
  exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "harbor==$VERSION"
"$VENV/bin/python" -c "from harbor.models.trajectories import Trajectory; print('harbor', '$VERSION')"
