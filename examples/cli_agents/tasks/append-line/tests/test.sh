#!/bin/bash
# reward 1 when notes.txt is its two lines then done
mkdir -p /logs/verifier
cd /app
check() { [ "$(cat notes.txt)" = "$(printf 'buy milk\ncall bob\ndone')" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
