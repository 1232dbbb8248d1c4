"""What the trainer needs from the rest of the system, as small protocols.

The trainer owns the loop and the step; it does not build engines, gateways or controllers.
Whoever runs it (a launcher in `relayrl.launch`: one process on a CPU, Ray actors, a service
fed by external agents) hands it a `Launcher`: given the actor, it starts what serves the
policy and returns `Services`: an engine the trainer pushes weights to, and a way to get batches
of rows for a workflow. A new way to run relayrl is a new launcher; this file does not change.

Some engines share this process's cores with the trainer's updates (an in-process engine); the
trainer learns of them only through the optional protocols below (`SharesCores`,
`ThreadedEngine`, `BusyEngine`), never by reaching into an engine.

Imports: rollout (for the batch record and its config) and typing only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from relayrl.rollout import Batch, RolloutConfig, RolloutStats
    from relayrl.train.actor import Actor
    from relayrl.train.config import EvalConfig, SFTConfig, TrainConfig


class TrainerSettings(Protocol):
    """The parts of a run's configuration the trainer reads (`relayrl.config.RelayConfig` fits)."""

    @property
    def seed(self) -> int: ...
    @property
    def model(self) -> str: ...
    @property
    def train(self) -> TrainConfig: ...
    @property
    def eval(self) -> EvalConfig: ...
    @property
    def sft(self) -> SFTConfig: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def checkpoint_dir(self) -> Path: ...
    @property
    def log_dir(self) -> Path: ...


class WeightSink(Protocol):
    """An inference engine that takes new weights (and stamps later tokens with `version`)."""

    async def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> Any: ...


@runtime_checkable
class ThreadedEngine(Protocol):
    """An engine that computes on this process's cores, on a number of torch threads it can change."""

    @property
    def num_threads(self) -> int: ...

    def set_threads(self, threads: int | None) -> None: ...


@runtime_checkable
class BusyEngine(Protocol):
    """An engine that says how many requests it has queued or running."""

    @property
    def active(self) -> int: ...


class BatchSource(Protocol):
    """Batches of whole groups of rows (a `RolloutController` is one)."""

    async def next_batch(self) -> Batch: ...
    def stats(self) -> RolloutStats: ...
    async def __aenter__(self) -> BatchSource: ...
    async def __aexit__(self, *exc: object) -> None: ...


class Services(Protocol):
    """What a launcher started for one run: the policy's engine and a source of batches."""

    @property
    def engine(self) -> WeightSink: ...

    def batches(self, workflow: Any, workflow_kwargs: dict[str, Any] | None,
                dataset: Sequence[dict[str, Any]], rollout: RolloutConfig,
                version_fn: Callable[[], int]) -> BatchSource: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class SharesCores(Protocol):
    """Services whose engines compute in this process: the torch threads they run on."""

    @property
    def engine_threads(self) -> int: ...


def engine_threads(services: Services) -> int:
    """Torch threads of the services' in-process engines (0 when they compute elsewhere)."""
    return int(services.engine_threads) if isinstance(services, SharesCores) else 0


def engine_busy(engine: WeightSink) -> bool:
    """Whether the engine says it has requests queued or running (False if it cannot say)."""
    return isinstance(engine, BusyEngine) and engine.active > 0


class Launcher(Protocol):
    """Starts the services of a run for this actor's model and weights."""

    async def __call__(self, actor: Actor) -> Services: ...
