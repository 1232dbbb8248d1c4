"""relayrl.rollout: the controller that runs episodes concurrently and batches them for training."""

from relayrl.rollout.config import RolloutConfig
from relayrl.rollout.controller import Batch, RolloutController, RolloutStats
from relayrl.rollout.staleness import StalenessGate

__all__ = ["Batch", "RolloutConfig", "RolloutController", "RolloutStats", "StalenessGate"]
