#!/bin/bash
mkdir -p /app/calc
: > /app/calc/__init__.py
printf 'def add(a, b):\n    return a + b\n' > /app/calc/ops.py
