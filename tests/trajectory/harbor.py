"""Harbor's own check of an exported ATIF file: its validator and its pydantic models, run in
.venv-harbor (scripts/install_harbor.sh), since Harbor needs a Python of its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARBOR_PY = ROOT / ".venv-harbor" / "bin" / "python"
needs_harbor = pytest.mark.skipif(not HARBOR_PY.exists(), reason="Harbor's venv is not "
                                  "installed (scripts/install_harbor.sh)")

_CHECK = """\
import json, sys
from harbor.models.trajectories import Trajectory
from harbor.utils.trajectory_validator import TrajectoryValidator
v = TrajectoryValidator()
ok = v.validate(sys.argv[1])
t = Trajectory.model_validate(json.load(open(sys.argv[1])))
subs = t.subagent_trajectories or []
print(json.dumps({"ok": ok, "errors": v.get_errors(), "facts": [%s]}, default=str))
"""


def harbor_validate(path: Path, *facts: str) -> list[object]:
    """Assert Harbor's validator accepts the ATIF file at `path` and its `Trajectory` model
    parses it; return the values of `facts`, Python expressions of `t` (the trajectory) and
    `subs` (its sub-agent trajectories) evaluated in Harbor's venv."""
    done = subprocess.run([str(HARBOR_PY), "-c", _CHECK % ", ".join(facts), str(path)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["ok"] is True and not out["errors"], out
    return out["facts"]
