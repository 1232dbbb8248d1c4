"""relayrl.workflow."""
