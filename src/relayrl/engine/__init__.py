"""relayrl.engine."""
