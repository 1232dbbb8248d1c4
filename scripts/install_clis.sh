#!/usr/bin/env bash
# The coding CLIs that relayrl's harness runner trains (docs/cli-agents/), from npm at pinned
# versions, into <repo>/.clis (override with RELAYRL_CLIS_DIR). The harness finds them there
# (`.clis/node_modules/.bin/<cli>`) before looking on PATH, so tests and examples use exactly
# these versions and nothing is installed globally. Needs Node.js >= 20 and npm.
# Idempotent: a CLI already installed at its pinned version is not installed again.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${RELAYRL_CLIS_DIR:-$ROOT/.clis}"
PINS=(
    "opencode-ai@1.18.33"
    "@openai/codex@0.171.0"
    "@anthropic-ai/claude-code@2.1.197"
    "@qwen-code/qwen-code@0.15.10"
)

command -v npm >/dev/null 2>&1 || { echo "install_clis.sh: npm not found (install Node.js >= 20)" >&2; exit 1; }
mkdir -p "$DEST"
missing=()
for pin in "${PINS[@]}"; do
    name="${pin%@*}"
    want="${pin##*@}"
    have="$(node -p "require('$DEST/node_modules/$name/package.json').version" 2>/dev/null || true)"
    [ "$have" = "$want" ] || missing+=("$pin")
done
if [ "${#missing[@]}" -gt 0 ]; then
    # every pin in one call, so .clis/package.json and its lockfile list exactly these
    npm install --prefix "$DEST" --no-audit --no-fund --loglevel=error --save-exact "${PINS[@]}"
fi
for bin in opencode codex claude qwen; do
    printf '%s %s\n' "$bin" "$("$DEST/node_modules/.bin/$bin" --version 2>/dev/null | head -1)"
done
