"""relayrl.service: the any-agent RL service: agents anywhere drive sessions over
HTTP, and the trainer learns from the trajectories they finalize.

Top layer, beside `relayrl.launch`; nothing below imports it.
"""

from relayrl.service.launcher import ServiceLauncher, ServiceServices
from relayrl.service.run import serve, serve_from_config

__all__ = [
    "ServiceLauncher",
    "ServiceServices",
    "serve",
    "serve_from_config",
]
