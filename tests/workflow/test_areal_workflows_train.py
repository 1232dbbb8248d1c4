"""One real training step of each of the AReaL's custom-workflow shapes, on the default model:
the tensor-dict one (the engine generates from token ids) through `relayrl.launch.train`, and the direct
approach (DirectClient made from the engine inside `arun_episode`) through `relayrl train`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

CONFIG = """\
experiment_name: seeds
trial_name: {trial}
fileroot: {root}
seed: 3
model: smollm2-135m-instruct
workflow: areal_workflows.DirectWorkflow
data:
  train: {data}
rollout:
  group_size: 2
  batch_size: 1
  max_concurrent_rollouts: 2
  episode_timeout_s: 240
  max_consecutive_aborts: 4
  progress: false
train:
  total_steps: 1
  drop_uniform_groups: false
  checkpoint_every: 0
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(HERE), str(ROOT)])
    return env


def _run_dir(tmp_path: Path, trial: str) -> Path:
    return tmp_path / "runs" / "seeds" / trial


def _config(tmp_path: Path, trial: str) -> Path:
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        for q in ("What is 2 + 2?", "Name a colour.", "Say hello."):
            f.write(json.dumps({"prompt": f"<|im_start|>user\n{q}<|im_end|>\n"
                                          "<|im_start|>assistant\n",
                                "messages": [{"role": "user", "content": q}]}) + "\n")
    cfg = tmp_path / f"{trial}.yaml"
    cfg.write_text(CONFIG.format(trial=trial, root=tmp_path / "runs", data=data))
    return cfg


def _one_step(run: Path) -> dict:
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "step_s" in m]
    assert [m["step"] for m in steps] == [1]
    assert (run / "checkpoints" / "step_1" / "config.json").exists()
    return steps[0]


@pytest.mark.slow
def test_relayrl_train_runs_a_direct_client_workflow_for_a_real_step(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "direct")
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", str(cfg)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = _one_step(_run_dir(tmp_path, "direct"))
    assert step["n_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_a_tensor_dict_workflow_trains_a_real_step_with_the_runs_engine(tmp_path: Path,
                                                                    launcher: str) -> None:
    cfg = _config(tmp_path, "tensor_dict")
    cfg.write_text(cfg.read_text() + f"launcher: {launcher}\n")
    script = tmp_path / "train_tensor_dict.py"
    script.write_text(
        "import json, sys\n"
        "from transformers import AutoTokenizer\n"
        "from relayrl.config import RelayConfig, load_config\n"
        "from relayrl.launch.run import train\n"
        "from relayrl.models import model_path\n"
        "from relayrl.workflow import GenerationHyperparameters\n"
        "from areal_workflows import MyWorkflow\n"
        "cfg = load_config(RelayConfig, sys.argv[1])\n"
        "tokenizer = AutoTokenizer.from_pretrained(model_path(cfg.model))\n"
        "items = [json.loads(x) for x in open(cfg.data.train)]\n"
        "result = train(cfg, items, workflow=MyWorkflow, workflow_kwargs={\n"
        "    'tokenizer': tokenizer, 'gconfig': GenerationHyperparameters(max_new_tokens=24)})\n"
        "print('steps', result.steps)\n")
    proc = subprocess.run([sys.executable, str(script), str(cfg)], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "steps 1" in proc.stdout
    step = _one_step(_run_dir(tmp_path, "tensor_dict"))
    assert step["n_tokens"] > 0


@pytest.mark.slow
def test_a_run_whose_episodes_start_failing_stops_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "failing")
    overrides = ["workflow=areal_workflows.FailsAfterFirstGroup", "train.total_steps=3",
                 "train.checkpoint_every=1"]
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", str(cfg), *overrides],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path, env=_env())
    assert proc.returncode == 1, proc.stderr[-3000:]
    error = next(line for line in proc.stderr.splitlines() if line.startswith("relayrl: error:"))
    assert "4 episodes in a row aborted" in error  # the count
    assert "RuntimeError: tool server down" in error  # the exception: type and message
    assert "areal_workflows.py:" in error and "in arun_episode" in error  # where
    assert "rollout.max_consecutive_aborts" in error
    # the step taken before the failures is kept: its metrics and its checkpoint
    run = _run_dir(tmp_path, "failing")
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "step_s" in m] == [1]
    assert (run / "checkpoints" / "step_1" / "config.json").exists()
