"""relayrl.client."""
