"""relayrl.chat."""
