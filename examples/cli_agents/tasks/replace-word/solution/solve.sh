#!/bin/bash
sed -i 's/colour/color/g' /app/README.txt
