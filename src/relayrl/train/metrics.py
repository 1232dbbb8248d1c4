"""`MetricsLogger`: per-step scalars to TensorBoard, to a JSONL file, and to a PNG plot.

The JSONL file (`metrics.jsonl`, one `{"step": N, ...}` object per line) is the record other
tools read; TensorBoard is for watching a run live; `plot` draws reward and loss against step
for a report. TensorBoard and matplotlib are imported only when used, so a logger that only
writes JSONL needs neither.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
DEFAULT_PLOT_KEYS = ("reward_mean", "loss")


class MetricsLogger:
    """Writes each step's metrics to `logdir` (TensorBoard events + metrics.jsonl)."""

    def __init__(self, logdir: str | Path, tensorboard: bool = True) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.logdir / METRICS_FILE
        self._writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.logdir))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one step's scalars (non-numbers are skipped; NaN is kept as null in JSONL)."""
        scalars = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        record = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in scalars.items()}}
        with self.jsonl_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def read(self) -> list[dict[str, Any]]:
        """Every record written so far (by this logger or an earlier one on the same folder)."""
        return read_metrics(self.jsonl_path)

    def plot(self, path: str | Path, keys: Sequence[str] = DEFAULT_PLOT_KEYS) -> Path:
        """Write a PNG with one panel per key, plotted against step."""
        return plot_metrics(self.read(), path, keys)

    def close(self) -> None:
        """Flush and close the TensorBoard writer."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Parse a metrics.jsonl file."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_metrics(
    records: Sequence[Mapping[str, Any]], path: str | Path, keys: Sequence[str] = DEFAULT_PLOT_KEYS
) -> Path:
    """Draw `keys` against step from metric records into a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker="." if len(points) < 50 else None)
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
