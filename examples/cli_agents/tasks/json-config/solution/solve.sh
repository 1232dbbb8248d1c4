#!/bin/bash
echo '{"name": "relayrl", "port": 8080}' > /app/config.json
