"""relayrl.chat.schema."""
