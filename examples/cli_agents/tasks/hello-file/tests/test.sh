#!/bin/bash
# reward 1 when /app/hello.txt holds exactly "hello relayrl" (a trailing newline allowed)
mkdir -p /logs/verifier
if [ "$(cat /app/hello.txt 2>/dev/null)" = "hello relayrl" ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
