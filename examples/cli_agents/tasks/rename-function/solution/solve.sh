#!/bin/bash
sed -i 's/\bcalc\b/order_total/g' /app/shop.py
