"""relayrl.gateway."""
