"""Supervised warm-start on recorded traces: maximise the logprob of the tokens a row trains on.

The rows are the same ones RL trains on (exported trajectories, `docs/trajectory-format.md`), so a
model warmed up here saw exactly the token layout the gateway will produce. The loss is the mean
negative logprob over all masked tokens of a batch (token-level, like the RL loss).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from tqdm import tqdm

from relayrl.train.actor import Actor
from relayrl.train.config import SFTConfig
from relayrl.train.packing import TrainBatch
from relayrl.trajectory.export import TrajectoryRow


def sft_step(actor: Actor, batch: TrainBatch, lr: float) -> dict[str, float]:
    """One optimizer step of token-level cross-entropy on the batch's masked tokens."""
    n_tokens = max(batch.num_trained_tokens, 1)
    actor.optimizer.zero_grad(set_to_none=True)
    total = actor.nll_backward(batch)
    grad_norm = actor.clip_gradients()
    actor.apply_gradients(lr)
    return {"sft_loss": total, "sft_grad_norm": grad_norm, "sft_tokens": float(n_tokens)}


def run_sft(actor: Actor, rows: Sequence[TrajectoryRow], config: SFTConfig, seed: int = 0,
            log: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
    """Imitate `rows` for `config.epochs`; returns per-step metrics. Bumps no version."""
    rows = list(rows)[: config.max_rows] if config.max_rows else list(rows)
    order = list(range(len(rows)))
    rng = random.Random(seed)
    history = []
    steps = config.epochs * -(-len(rows) // config.rows_per_step)
    bar = tqdm(total=steps, desc="sft", unit="step")
    for _ in range(config.epochs):
        rng.shuffle(order)
        for start in range(0, len(order), config.rows_per_step):
            picked = [rows[i] for i in order[start: start + config.rows_per_step]]
            t = time.perf_counter()
            metrics = sft_step(actor, TrainBatch.from_rows(picked), config.lr)
            metrics["sft_step_s"] = time.perf_counter() - t
            history.append(metrics)
            if log is not None:
                log(len(history), metrics)
            bar.set_postfix(loss=f"{metrics['sft_loss']:.3f}")
            bar.update()
    bar.close()
    return history
