"""`MetricsLogger`: per-step scalars to TensorBoard, to a JSONL file, and to a PNG plot; and the
episode metrics of a batch (`episode_metrics`: tool use, turns, segments).

The JSONL file (`metrics.jsonl`, one `{"step": N, ...}` object per line) is the record other
tools read (`relayrl view` draws it live); TensorBoard is for watching a run live; `plot` draws
the run for a report: held-out evaluations with error bars beside a smoothed training reward,
so a reader can tell learning from noise. TensorBoard and matplotlib are imported only when used,
so a logger that only writes JSONL needs neither.

May import: `relayrl.trajectory` (row records); torch only inside `MetricsLogger(tensorboard=True)`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relayrl.trajectory.batch import RowBatch

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

    def plot(self, path: str | Path, keys: Sequence[str] | None = None) -> Path:
        """Write a PNG: the training overview (`plot_training`), or one panel per key in `keys`."""
        if keys is None:
            return plot_training(self.read(), path)
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


def episode_metrics(batch: RowBatch) -> dict[str, float]:
    """Tool use, turns and segments of a batch's episodes (from the rows' per-call metadata).

    Calls are counted once per episode even when several rows (paths of a segment tree) share
    them. `tool_call_rate`: calls with at least one tool call, over calls. `tool_parse_failure_rate`:
    calls whose tool call did not parse, over calls. `rewarded_without_tools`: episodes with a
    positive reward and no tool call, over rewarded episodes (the silent failure of tool-use RL:
    the policy earns reward by answering directly). Keys are absent when the rows lack the data.
    """
    calls: dict[str, dict[str, tuple[int, int, str]]] = {}
    segments: dict[str, set[str]] = {}
    reward: dict[str, float] = {}
    for row, episode in zip(batch.rows, batch.episode_ids, strict=True):
        meta = row.metadata
        n = len(row.interaction_ids)
        tools = meta.get("tool_calls") or [0] * n
        fails = meta.get("tool_parse_failures") or [0] * n
        finish = meta.get("finish_reasons") or [""] * n
        mine = calls.setdefault(episode, {})
        for cid, t, f, fr in zip(row.interaction_ids, tools, fails, finish, strict=False):
            mine[cid] = (int(t), int(f), str(fr))
        segments.setdefault(episode, set()).add(row.segment_id)
        reward[episode] = max(row.reward, reward.get(episode, float("-inf")))
    every = [c for ep in calls.values() for c in ep.values()]
    if not every:
        return {}
    out = {
        "tool_call_rate": sum(t > 0 for t, _, _ in every) / len(every),
        "tool_calls_per_call": sum(t for t, _, _ in every) / len(every),
        "tool_parse_failure_rate": sum(f > 0 for _, f, _ in every) / len(every),
        "truncated_call_rate": sum(fr == "length" for _, _, fr in every) / len(every),
        "turns_per_episode": len(every) / len(calls),
        "segments_per_episode": sum(len(s) for s in segments.values()) / len(segments),
    }
    rewarded = [ep for ep, r in reward.items() if r > 0]
    if rewarded:
        silent = sum(all(t == 0 for t, _, _ in calls[ep].values()) for ep in rewarded)
        out["rewarded_without_tools"] = silent / len(rewarded)
    return out


ROLE_PREFIX = "role/"
"""Per-role metrics are `role/{role}/{name}` (metrics.jsonl, TensorBoard, the PNG's role panel)."""


def role_metrics(batch: RowBatch) -> dict[str, float]:
    """Per role of a batch's rows: reward mean over its episodes, episodes, rows, trained tokens,
    calls per episode (`role/{role}/...`); empty when no row has a role."""
    if all(row.role is None for row in batch.rows):
        return {}
    rewards: dict[str, dict[str, list[float]]] = {}
    rows: dict[str, int] = {}
    tokens: dict[str, int] = {}
    calls: dict[str, dict[str, set[str]]] = {}
    for row, episode in zip(batch.rows, batch.episode_ids, strict=True):
        role = row.role or "none"
        rewards.setdefault(role, {}).setdefault(episode, []).append(row.reward)
        rows[role] = rows.get(role, 0) + 1
        tokens[role] = tokens.get(role, 0) + sum(row.loss_mask)
        calls.setdefault(role, {}).setdefault(episode, set()).update(row.interaction_ids)
    out: dict[str, float] = {}
    for role, per_episode in rewards.items():
        means = [sum(r) / len(r) for r in per_episode.values()]  # an episode counts once
        p = f"{ROLE_PREFIX}{role}/"
        out[p + "reward_mean"] = sum(means) / len(means)
        out[p + "episodes"] = float(len(means))
        out[p + "rows"] = float(rows[role])
        out[p + "trained_tokens"] = float(tokens[role])
        out[p + "calls_per_episode"] = (sum(len(c) for c in calls[role].values())
                                        / len(calls[role]))
    return out


def trained_tokens(batch: RowBatch) -> int:
    """Tokens that carry loss (the policy's own samples) in a batch."""
    return sum(sum(row.loss_mask) for row in batch.rows)


def smooth(values: Sequence[float], alpha: float = 0.3) -> list[float]:
    """Exponential moving average, bias-corrected so the first points are not pulled to 0."""
    out: list[float] = []
    avg, weight = 0.0, 0.0
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def eval_points(records: Sequence[Mapping[str, Any]],
                key: str = "eval_reward") -> list[tuple[float, float, float, str]]:
    """Held-out evaluations of `key` as (step, value, standard error, label), in step order.

    Before RL (`{key}_before`, at `eval_before_step`), every `eval.every` steps (`{key}`),
    after RL (`{key}_after`, at its record's step); standard errors from `..._se` (else 0).
    """
    points: list[tuple[float, float, float, str]] = []
    for r in records:
        step = float(r["step"])
        for label, name in (("during", key), ("before", f"{key}_before"),
                            ("after", f"{key}_after")):
            value = r.get(name)
            if value is None:
                continue
            at = r.get("eval_before_step") if label == "before" else step
            points.append((float(at if at is not None else 0.0), float(value),
                           float(r.get(f"{name}_se") or 0.0), label))
    return sorted(points, key=lambda p: p[0])


_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss",)),
    ("KL", ("approx_kl", "ref_kl")),
    ("tool use per call", ("tool_call_rate", "tool_parse_failure_rate", "rewarded_without_tools")),
    ("per episode", ("turns_per_episode", "segments_per_episode")),
    ("trained tokens / s", ("trained_tokens_per_s",)),
    ("aborted episodes by reason (cumulative)", ("aborted_episodes",)),
)


def _plot_roles(ax: Any, records: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> None:
    """Training reward per role (smoothed), one line per role."""
    for key in keys:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            steps, values = zip(*points, strict=True)
            role = key[len(ROLE_PREFIX):-len("/reward_mean")]
            ax.plot(steps, smooth(values), marker="." if len(points) < 50 else None, label=role)
    ax.set_title("training reward per role (EMA)", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def plot_training(records: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """The run at a glance: held-out reward (error bars) over smoothed training reward, then
    loss, KL, tool use, turns and segments per episode, and throughput."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(11, 12), squeeze=False)
    role_keys = sorted({k for r in records for k in r
                        if k.startswith(ROLE_PREFIX) and k.endswith("/reward_mean")})
    if role_keys:
        _plot_roles(axes[-1, -1], records, role_keys)
    else:
        axes[-1, -1].set_visible(False)
    ax = axes[0, 0]
    train = [(r["step"], r["reward_mean"]) for r in records if r.get("reward_mean") is not None]
    if train:
        steps, values = zip(*train, strict=True)
        ax.plot(steps, values, color="tab:blue", alpha=0.25, marker=".", lw=0.8,
                label="training batch reward")
        ax.plot(steps, smooth(values), color="tab:blue", lw=2, label="training reward (EMA)")
    evals = eval_points(records)
    if evals:
        xs, ys, ses, labels = zip(*evals, strict=True)
        ax.errorbar(xs, ys, yerr=ses, color="tab:red", marker="o", capsize=4, lw=1.5,
                    label="held-out eval ± s.e.")
        for x, y, label in zip(xs, ys, labels, strict=True):
            if label != "during":
                ax.annotate(f"{label} {y:.3f}", (x, y), textcoords="offset points",
                            xytext=(4, 6), fontsize=8, color="tab:red")
    ax.set_title("did the agent learn? (held-out reward vs training reward)", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend(fontsize=8, loc="best")
    reasons = sorted({k for r in records for k in r if k.startswith("aborted/")})
    for ax, (title, keys) in zip(axes.flat[1:], _PANELS, strict=False):
        if title.startswith("aborted"):
            keys = (*keys, *reasons)
        drawn = False
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="." if len(points) < 50 else None, label=key)
                drawn = True
        if title.startswith("tool"):
            tool_evals = eval_points(records, "eval_tool_call_rate")
            if tool_evals:
                steps, values, _, _ = zip(*tool_evals, strict=True)
                ax.plot(steps, values, "s--", color="tab:red", label="held-out tool_call_rate")
                drawn = True
        if drawn:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                    color="gray")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
