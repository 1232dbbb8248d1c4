#!/bin/bash
# reward 1 when ./count_lines.sh FILE prints FILE's line count
mkdir -p /logs/verifier
cd /app
sample="$(mktemp)"
trap 'rm -f "$sample"' EXIT
check() { printf "a\nb\nc\n" > "$sample"; [ -x count_lines.sh ] && [ "$(./count_lines.sh "$sample" | tr -d '[:space:]')" = "3" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
