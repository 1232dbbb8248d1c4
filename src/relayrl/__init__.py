"""relayrl: train LLM agents with RL, whatever framework they are written in.

Importing the package imports nothing else; each layer is its own subpackage (bottom to top:
types, chat, trajectory, engine, gateway, client, workflow, rollout, train; then the command
line). docs/design-decisions.md says where a new engine, wire format or credit rule goes.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
