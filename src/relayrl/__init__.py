"""relayrl: train LLM agents with RL, whatever framework they are written in."""

__version__ = "0.1.0"
