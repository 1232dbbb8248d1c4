"""relayrl.train: advantages and losses (pure tensor functions), the `Actor` (model, optimizer,
micro-batches), checkpoints and metrics. The loop that drives them lives in the trainer."""

from relayrl.train.actor import Actor
from relayrl.train.advantages import Advantages, compute_advantages
from relayrl.train.checkpoint import latest_checkpoint
from relayrl.train.losses import LossInputs, LossOutput, ppo_loss
from relayrl.train.metrics import MetricsLogger
from relayrl.train.packing import TrainBatch

__all__ = [
    "Actor",
    "Advantages",
    "LossInputs",
    "LossOutput",
    "MetricsLogger",
    "TrainBatch",
    "compute_advantages",
    "latest_checkpoint",
    "ppo_loss",
]
