"""The trainer entry point a script imports: `from relayrl import PPOTrainer`, used in a `with`
block with a dataset and a workflow named by path, class or instance; `config_from_args` for a
script's `--config cfg.yaml key=value` command line; `relayrl train --config CFG`.

The slow test runs AReaL's training script with relayrl's names, for real: the default model,
one step, through `python train.py --config cfg.yaml key=value ...`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import relayrl.launch.run as launch_run
from relayrl.cli import main as cli_main
from relayrl.config import RelayConfig, config_from_args, load_config
from relayrl.errors import ConfigError

SRC = str(Path(__file__).resolve().parents[2] / "src")
ITEMS = [{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"},
         {"messages": [{"role": "user", "content": "What is 3 * 3?"}], "answer": "9"}]


def _python(code: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_relayrl_exports_the_trainer_and_the_config_loader_on_first_use() -> None:
    result = _python("""
        import sys
        import relayrl
        assert "torch" not in sys.modules, "import relayrl imported torch"
        from relayrl import PPOTrainer, RelayConfig, config_from_args, load_dataset
        from relayrl.launch.trainer import PPOTrainer as launch_trainer
        assert PPOTrainer is launch_trainer
        assert hasattr(PPOTrainer, "__enter__") and hasattr(PPOTrainer, "__exit__")
        assert "PPOTrainer" in dir(relayrl)
        try:
            relayrl.NoSuchName
        except AttributeError as e:
            print("ok", e)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok") and "NoSuchName" in result.stdout


class _Recorded:
    """What `relayrl.launch.run.train` was called with."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, config: RelayConfig, train_dataset: Any, eval_dataset: Any = None,
                 **kwargs: Any) -> str:
        self.calls.append({"config": config, "train": train_dataset, "eval": eval_dataset,
                           **kwargs})
        return "result"


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> _Recorded:
    rec = _Recorded()
    monkeypatch.setattr(launch_run, "train", rec)
    return rec


class MathAgent:
    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        return 0.0


def test_a_with_block_trains_what_the_seed_passes_and_then_closes(recorded: _Recorded) -> None:
    from relayrl import PPOTrainer

    config = load_config(RelayConfig, None, ["rollout.group_size=2"])
    with PPOTrainer(config, train_dataset=ITEMS) as trainer:
        assert trainer.train(workflow="my_agent.MathAgent") == "result"
        trainer.train(workflow=MathAgent)
        trainer.train(workflow=MathAgent(), workflow_kwargs=None)
    assert recorded.calls[0]["workflow"] == "my_agent.MathAgent"
    assert recorded.calls[1]["workflow"] is MathAgent
    assert isinstance(recorded.calls[2]["workflow"], MathAgent)
    assert recorded.calls[0]["train"] == ITEMS and recorded.calls[0]["config"] is config
    with pytest.raises(ConfigError, match="closed"):
        trainer.train(workflow="my_agent.MathAgent")


def test_the_workflow_and_its_kwargs_default_to_the_config(recorded: _Recorded,
                                                            tmp_path: Path) -> None:
    from relayrl import PPOTrainer

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    config = load_config(RelayConfig, None, [
        "workflow=my_agent.MathAgent", "workflow_kwargs.max_tokens=24", f"data.train={data}",
        f"data.eval={data}", "eval.workflow_kwargs.temperature=0"])
    with PPOTrainer(config) as trainer:  # datasets from data.train / data.eval
        trainer.train()
    call = recorded.calls[0]
    assert call["workflow"] == "my_agent.MathAgent" and call["train"] == ITEMS
    assert call["eval"] == ITEMS
    assert call["workflow_kwargs"] == {"max_tokens": 24}
    assert call["eval_workflow_kwargs"] == {"temperature": 0}
    with pytest.raises(ConfigError, match="workflow"):
        PPOTrainer(load_config(RelayConfig), train_dataset=ITEMS).train()
    with pytest.raises(ConfigError, match="eval_workflow_kwargs"):
        PPOTrainer(config).train(workflow=MathAgent, eval_workflow="other.Agent")


class _HFLikeDataset:
    """What a `datasets.Dataset` offers the trainer: `to_list()` of row dicts, `len`, iteration."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Any:
        return iter(self._rows)

    def to_list(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._rows]


def test_datasets_come_as_lists_tables_files_or_dataset_objects(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from relayrl import PPOTrainer

    config = load_config(RelayConfig)
    rows = [{"q": "a", "answer": "1"}, {"q": "b", "answer": "2"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for ds in (rows, iter(rows), _HFLikeDataset(rows), pa.Table.from_pylist(rows),
               str(tmp_path / "d.parquet")):
        assert PPOTrainer(config, train_dataset=ds).train_dataset == rows
    trainer = PPOTrainer(config, rows, valid_dataset=_HFLikeDataset(rows[:1]))
    assert trainer.eval_dataset == rows[:1]
    with pytest.raises(ConfigError, match=r"pass one split, e.g. train_dataset=ds\['train'\]"):
        PPOTrainer(config, train_dataset={"train": rows, "test": rows})
    with pytest.raises(ConfigError, match=r"train_dataset\[1\]: expected a dict"):
        PPOTrainer(config, train_dataset=[rows[0], "oops"])
    with pytest.raises(ConfigError, match="expected a list of dicts"):
        PPOTrainer(config, train_dataset=3)
    with pytest.raises(ConfigError, match=r"no data\.train"):
        PPOTrainer(config)
    with pytest.raises(ConfigError, match="empty"):
        PPOTrainer(config, train_dataset=[])
    with pytest.raises(ConfigError, match="same dataset"):
        PPOTrainer(config, rows, rows, valid_dataset=rows)
    with pytest.raises(ConfigError, match="expected a RelayConfig"):
        PPOTrainer((config, None), train_dataset=rows)  # type: ignore[arg-type]


def test_a_script_command_line_loads_through_config_from_args(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("experiment_name: ported\nrollout: {group_size: 4}\n")
    config = config_from_args(["--config", str(cfg), "rollout.batch_size=3", "train.lr=1e-5"])
    assert isinstance(config, RelayConfig)
    assert (config.experiment_name, config.rollout.group_size, config.rollout.batch_size,
            config.train.lr) == ("ported", 4, 3, 1e-5)
    # overrides before the flag, `--config=`, and no file at all
    assert config_from_args(["trial_name=b", f"--config={cfg}"]).trial_name == "b"
    assert config_from_args(["seed=5"]).seed == 5
    with pytest.raises(ConfigError, match=r"rollout\.group_sise"):
        config_from_args(["--config", str(cfg), "rollout.group_sise=2"])
    with pytest.raises(SystemExit):
        config_from_args(["--confg", str(cfg)])


def test_relayrl_train_takes_the_config_as_a_flag_too(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"workflow: my_agent.MathAgent\ndata: {{train: {tmp_path / 'absent.jsonl'}}}\n")
    # each form reaches the config (it names a dataset that is not there: refused before any
    # model loads), overrides before or after the flag
    for argv in (["train", str(cfg)], ["train", "--config", str(cfg)],
                 ["train", f"--config={cfg}", "seed=3"], ["train", "seed=3", "--config", str(cfg)]):
        assert cli_main(argv) == 1, argv
        assert "absent.jsonl does not exist" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(cfg), "rollout.openai.mode=nope"]) == 1
    assert "rollout.openai.mode (relayrl's rollout.agent.mode)" in capsys.readouterr().err
    assert cli_main(["train", str(cfg), "--config", str(cfg)]) == 1
    assert "two configs" in capsys.readouterr().err
    assert cli_main(["train"]) == 1
    assert "name a config" in capsys.readouterr().err


# -- the seed's script, with relayrl's names, for real ----------------------------------------

TRAIN_PY = '''
import sys

from relayrl import PPOTrainer, config_from_args, load_dataset


def main(args):
    config = config_from_args(args)

    train_dataset = load_dataset(config.data.train)

    with PPOTrainer(
        config,
        train_dataset=train_dataset
    ) as trainer:
        trainer.train(
            workflow="my_agent.MathAgent"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
'''

MY_AGENT_PY = '''
import json
import os
import uuid

from openai import AsyncOpenAI


class MathAgent:
    async def run(self, data, **extra_kwargs):
        http_client = extra_kwargs.get("http_client", None)
        base_url = extra_kwargs.get("base_url", None)
        api_key = extra_kwargs.get("api_key", None)
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client,
                             max_retries=0)
        response = await client.chat.completions.create(
            model="default", messages=data["messages"], max_tokens=12)
        content = response.choices[0].message.content or ""
        with open(os.path.join(os.environ["AGENT_LOG"], uuid.uuid4().hex), "w") as f:
            json.dump({"id": response.id, "content": content}, f)
        return float(data["answer"] in content)
'''


@pytest.mark.slow
def test_the_seed_training_script_trains_one_step_of_the_default_model(tmp_path: Path) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(TRAIN_PY)
    (job / "my_agent.py").write_text(MY_AGENT_PY)
    (job / "train.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    (job / "config.yaml").write_text(textwrap.dedent(f"""\
        experiment_name: ported
        trial_name: t1
        fileroot: {tmp_path / 'runs'}
        data: {{train: train.jsonl}}
        engine: {{num_threads: 1}}
        rollout:
          group_size: 2
          batch_size: 1
          max_concurrent_rollouts: 2
          episode_timeout_s: 120
          progress: false
          openai: {{mode: inline}}      # AReaL's keys, accepted
          dump_to_file: true
        train: {{total_steps: 1, lr: 1.0e-5, checkpoint_every: 0, save_optimizer: false,
                 drop_uniform_groups: false}}
        """))
    (job / "agent_log").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
           "AGENT_LOG": str(job / "agent_log")}
    proc = subprocess.run([sys.executable, "train.py", "--config", "config.yaml",
                           "scheduler.type=local", "seed=2"],
                          cwd=job, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "ported" / "t1"
    assert (run / "checkpoints" / "step_1" / "config.json").exists()
    steps = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "step_s" in m] == [1]
    # the agent really ran: the two episodes of the step's group, at least
    calls = [json.loads(p.read_text()) for p in (job / "agent_log").iterdir()]
    assert len(calls) >= 2 and all(c["id"] for c in calls)
    # the run records its config in relayrl's own keys, and AReaL's dump settings took effect
    recorded = load_config(RelayConfig, run / "config.yaml")
    assert recorded.rollout.dump_root == str(tmp_path / "runs") and recorded.launcher == "local"
    assert recorded.seed == 2
    dumps = list((run / "rollout").glob("*/*.jsonl"))
    assert dumps, sorted(p.relative_to(run) for p in run.rglob("*"))
    line = json.loads(dumps[0].read_text().splitlines()[0])
    assert line["completion"] and isinstance(line["completion"], str)
