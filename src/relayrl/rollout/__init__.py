"""relayrl.rollout."""
