"""relayrl.launch: builds engines, gateways and controllers from a config and runs the trainer.

The top layer (with `relayrl.config` and the CLI): it may import every layer below; nothing
below imports it. A new way to run relayrl (Ray actors, several trainer ranks, a service fed by
external agents, a remote engine) is a new launcher here.
"""

from relayrl.launch.local import LocalLauncher, LocalServices
from relayrl.launch.process import add_import_path, keep_freed_heap
from relayrl.launch.run import make_launcher, run_from_config, train

__all__ = [
    "LocalLauncher",
    "LocalServices",
    "add_import_path",
    "keep_freed_heap",
    "make_launcher",
    "run_from_config",
    "train",
]
