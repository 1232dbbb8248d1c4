#!/bin/bash
# reward 1 when python3 greet.py prints hello, world
mkdir -p /logs/verifier
cd /app
check() { [ "$(python3 greet.py)" = "hello, world" ]; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
