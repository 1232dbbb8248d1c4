#!/bin/bash
# reward 1 when shop.py has order_total (and no calc) and receipt still works
mkdir -p /logs/verifier
cd /app
check() { python3 -c "import shop; assert not hasattr(shop, 'calc'); assert shop.order_total([1, 2]) == 3; assert shop.receipt([2, 3]) == 'total: 5'"; }
if check; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
