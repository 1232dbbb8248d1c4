#!/bin/bash
echo "hello relayrl" > /app/hello.txt
