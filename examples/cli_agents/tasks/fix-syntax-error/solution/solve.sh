#!/bin/bash
sed -i 's/def greet(name)$/def greet(name):/' /app/greet.py
