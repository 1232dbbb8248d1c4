#!/bin/bash
# reward 1 when README.txt says color everywhere and nothing else changed
mkdir -p /logs/verifier
cd /app
check() { [ "$(cat README.txt)" = "$(printf 'Pick a color.\nThe color of the sky is blue.\nNo other changes.')" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
