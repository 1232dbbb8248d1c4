"""An `Actor` updated on one worker thread, as the trainer runs it: the setting the `heap` and
`lora` benchmarks time.

The trainer runs every update on one thread of its own (a thread's glibc arena is not the main
thread's) with 2 torch threads; `UpdateWorker` loads the actor there, builds bench_train's rows
and their advantages, and runs each call there too. torch is imported when a worker starts, so
the benchmarks list without it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from relayrl.train.actor import Actor
    from relayrl.train.advantages import Advantages
    from relayrl.train.config import TrainConfig

T = TypeVar("T")
TORCH_THREADS = 2
"""The trainer's torch threads on a CPU update."""


class UpdateWorker:
    """An actor of `model` with `cfg`, loaded and updated on its own thread."""

    def __init__(self, model: str, cfg: TrainConfig) -> None:
        from relayrl.models import model_path
        from relayrl.train.actor import Actor

        self.cfg = cfg
        self._pool = ThreadPoolExecutor(max_workers=1)  # the trainer's one update thread
        self.actor: Actor = self.run(Actor, model_path(model), cfg)
        self.adv: Advantages | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the worker thread; its result."""
        import torch

        def call() -> T:
            torch.set_num_threads(TORCH_THREADS)
            return fn(*args)

        return self._pool.submit(call).result()

    def prepare(self, n_rows: int, rows: str = "agent") -> None:
        """bench_train's `n_rows` agent rows (or random ones: `rows="random"`) and their
        advantages, then one warm-up update."""
        from benchmarks.bench_train import agent_batch, synthetic_batch
        from relayrl.train.advantages import compute_advantages

        vocab = self.actor.model.config.vocab_size
        batch = agent_batch(n_rows, vocab) if rows == "agent" else synthetic_batch(n_rows, vocab)
        self.adv = compute_advantages(batch, self.cfg)
        self.update()

    def update(self) -> dict[str, float]:
        """One update on the prepared rows; its metrics."""
        assert self.adv is not None, "prepare() first"
        return self.run(self.actor.update, self.adv.batch, self.adv.adv_B_T)

    def close(self) -> None:
        """Stop the worker thread."""
        self._pool.shutdown()
