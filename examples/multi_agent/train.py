"""Train the triage -> specialist handoff pipeline (handoff.py) per role, on CPU.

`relayrl.launch.train` runs the default model behind an in-process gateway with roles on: every
call of the triage agent is recorded as `triage`, every call of the specialist as `specialist`,
each role's rows are grouped and normalised only with the same role's, and metrics.jsonl,
TensorBoard and the plot carry `role/triage/...` and `role/specialist/...`.

    python examples/multi_agent/train.py [dotted.overrides ...]
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from relayrl.config import RelayConfig, load_config  # noqa: E402
from relayrl.launch import train  # noqa: E402
from relayrl.train.trainer import load_dataset  # noqa: E402


def role_summary(metrics: Path) -> str:
    """Each role's training reward at the first and the last step of a run."""
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    keys = sorted({k for r in records for k in r
                   if k.startswith("role/") and k.endswith("/reward_mean")})
    lines = []
    for key in keys:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            lines.append(f"{key}: first step {values[0]:.3f}, last step {values[-1]:.3f}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Train once with the config and the overrides; print each role's reward."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = load_config(RelayConfig, HERE / "config.yaml", argv)
    result = train(cfg, load_dataset(cfg.data.train), workflow=cfg.workflow,
                   workflow_kwargs=cfg.workflow_kwargs)
    print(result.summary())
    metrics = Path(cfg.fileroot) / cfg.experiment_name / cfg.trial_name / "logs" / "metrics.jsonl"
    if metrics.is_file():
        print(role_summary(metrics))


if __name__ == "__main__":
    main(sys.argv[1:])
