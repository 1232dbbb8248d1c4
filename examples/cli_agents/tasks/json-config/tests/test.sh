#!/bin/bash
# reward 1 when config.json is exactly {name: relayrl, port: 8080}
mkdir -p /logs/verifier
cd /app
check() { python3 -c "import json; d = json.load(open('config.json')); assert d == {'name': 'relayrl', 'port': 8080}"; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
