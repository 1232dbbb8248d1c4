"""relayrl.trajectory."""
