#!/usr/bin/env bash
# Installs the agent frameworks that cannot share relayrl's environment, for examples/frameworks.
# camel-ai pins pydantic<=2.12.0 (and older psutil, websockets, tiktoken) while relayrl's other
# dependencies need a newer pydantic, so it goes into .venv-camel: a venv that also sees the main
# environment's packages (torch, relayrl's dependencies) but shadows them with camel-ai's pins.
# The other frameworks are pinned in pyproject's `frameworks` extra. No npm: the Claude Agent
# SDK's wheel bundles the Claude Code CLI it drives.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-camel/bin/python ]; then
  python -m venv --system-site-packages .venv-camel
fi
# mcp<2: camel-ai imports mcp.server.FastMCP, which mcp 2 (in the main environment) moved
.venv-camel/bin/python -m pip install --quiet --disable-pip-version-check camel-ai==0.2.90 mcp==1.30.0
