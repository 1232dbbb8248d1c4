#!/bin/bash
# reward 1 when ./count_lines.sh FILE prints FILE's line count
mkdir -p /logs/verifier
cd /app
check() { printf "a\nb\nc\n" > /tmp/relayrl-cl-$$.txt; [ -x count_lines.sh ] && [ "$(./count_lines.sh /tmp/relayrl-cl-$$.txt | tr -d '[:space:]')" = "3" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
