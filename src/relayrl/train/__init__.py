"""relayrl.train."""
