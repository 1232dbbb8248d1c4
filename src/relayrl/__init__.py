"""relayrl: train LLM agents with RL, whatever framework they are written in.

Importing the package imports nothing else; each layer is its own subpackage (bottom to top:
types, chat, trajectory, engine, gateway, client, workflow, rollout, train; then the command
line). docs/design-decisions.md says where a new engine, wire format or credit rule goes.

The names a training script needs are here too, imported on first use (they bring the trainer,
and torch with it; `import relayrl` alone never does):

```python
from relayrl import PPOTrainer, config_from_args, load_dataset
```
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "PPOTrainer": "relayrl.launch.trainer",
    "RelayConfig": "relayrl.config",
    "config_from_args": "relayrl.config",
    "load_config": "relayrl.config",
    "load_dataset": "relayrl.train.trainer",
}

__all__ = ["PPOTrainer", "RelayConfig", "__version__", "config_from_args", "load_config",
           "load_dataset"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'relayrl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
