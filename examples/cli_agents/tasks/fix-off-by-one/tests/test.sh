#!/bin/bash
# reward 1 when mathx.total(n) sums 1..n
mkdir -p /logs/verifier
cd /app
check() { python3 -c "import mathx; assert mathx.total(1) == 1 and mathx.total(4) == 10 and mathx.total(10) == 55"; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
