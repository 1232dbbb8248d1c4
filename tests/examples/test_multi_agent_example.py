"""The multi-agent example: the OpenAI Agents SDK triage -> specialist pipeline trained per role,
with the real default model, the real gateway and the trainer (examples/multi_agent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("agents", reason="the example needs openai-agents (pip install openai-agents)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multi_agent"


@pytest.mark.slow
def test_one_group_trains_each_role_in_its_own_group(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    overrides = [f"fileroot={tmp_path / 'runs'}", "trial_name=ci", "train.total_steps=1",
                 "rollout.group_size=2", "rollout.batch_size=1",
                 "rollout.max_concurrent_rollouts=2", "workflow_kwargs.max_tokens=8",
                 f"rollout.dump_root={dumps}",
                 "train.drop_uniform_groups=false"]  # the one batch takes a step
    proc = subprocess.run([sys.executable, str(EXAMPLE / "train.py"), *overrides],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for f in sorted(dumps.rglob("*.jsonl"))
            for x in f.read_text().splitlines()]
    assert {r["role"] for r in rows} == {"triage", "specialist"}, rows
    groups: dict[str, set[str]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], set()).add(r["role"])
        assert r["group_id"].endswith("/" + r["role"])  # relayrl's group, split per role
    assert all(len(roles) == 1 for roles in groups.values()), groups  # never mixed
    assert len(groups) == 2
    # per-role rewards: the triage agent's is whether it handed off, the specialist's the answer
    assert all(r["reward"] in (0.0, 1.0) for r in rows)
    run = tmp_path / "runs" / "multi_agent" / "ci" / "logs"
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    stepped = [m for m in metrics if "step_s" in m]
    assert len(stepped) == 1
    for role in ("triage", "specialist"):
        assert stepped[0][f"role/{role}/episodes"] == 2.0
        assert stepped[0][f"role/{role}/trained_tokens"] > 0
    assert "role/triage/reward_mean" in proc.stdout  # the script's per-role summary
    assert list(run.glob("events.out.tfevents.*")), "TensorBoard events were written"
