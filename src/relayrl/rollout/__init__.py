"""relayrl.rollout: the controller that runs episodes concurrently and batches them for training.

May import: `relayrl.workflow`, `relayrl.trajectory` (the staleness rule), `relayrl.errors`.
Never train, launch or the gateway's modules (it reaches a gateway through a workflow's client).
"""

from relayrl.rollout.config import RolloutConfig
from relayrl.rollout.controller import Batch, RolloutController, RolloutStats
from relayrl.rollout.staleness import StalenessGate

__all__ = ["Batch", "RolloutConfig", "RolloutController", "RolloutStats", "StalenessGate"]
