#!/bin/bash
# reward 1 when calc/ is a package whose ops.add adds
mkdir -p /logs/verifier
cd /app
check() { [ -f calc/__init__.py ] && python3 -c "from calc.ops import add; assert add(2, 3) == 5"; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
