"""Configs ported from AReaL: its agent-workflow keys are accepted where relayrl has the setting
(`rollout.openai.mode`, `rollout.openai.subproc_max_workers`, `rollout.dump_to_file` with
`rollout.fileroot`, `scheduler.type`), and its other keys are refused naming relayrl's key."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from relayrl.config import AREAL_REFUSED, AREAL_RENAMED, RelayConfig, load_config, to_dict
from relayrl.errors import ConfigError
from relayrl.workflow.agent import AgentMode


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_the_agent_workflow_keys_of_an_areal_yaml_set_relayrls_settings(tmp_path: Path) -> None:
    cfg = load_config(RelayConfig, _yaml(tmp_path, """\
        fileroot: /data/runs
        rollout:
          group_size: 4
          openai:
            mode: subproc
            subproc_max_workers: 3
          dump_to_file: true
          fileroot: /data/dumps
        scheduler:
          type: local
        """))
    assert cfg.rollout.agent.mode == AgentMode.SUBPROCESS
    assert cfg.rollout.agent.subproc_max_workers == 3
    assert cfg.rollout.dump_root == "/data/dumps" and cfg.rollout.group_size == 4
    assert cfg.launcher == "local"
    # what a run writes down is relayrl's keys only
    saved = to_dict(cfg)
    assert "openai" not in saved["rollout"] and "dump_to_file" not in saved["rollout"]
    assert "scheduler" not in saved


def test_the_same_keys_work_as_command_line_overrides() -> None:
    cfg = load_config(RelayConfig, None, [
        "fileroot=/r", "rollout.openai.mode=inline", "rollout.openai.subproc_max_workers=2",
        "rollout.dump_to_file=true", "scheduler.type=ray"])
    assert cfg.rollout.agent.mode == AgentMode.INLINE
    assert cfg.rollout.agent.subproc_max_workers == 2
    assert cfg.rollout.dump_root == "/r"  # no rollout.fileroot: under the run's fileroot
    assert cfg.launcher == "ray"
    off = load_config(RelayConfig, None, ["rollout.dump_to_file=false"])
    assert off.rollout.dump_root is None
    assert load_config(RelayConfig, None, ["rollout.dump_to_file=false",
                                           "rollout.fileroot=/x"]).rollout.dump_root is None


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.tokenizer_path=Qwen/Qwen3-1.7B"],
     r"rollout\.tokenizer_path: this is an AReaL key; relayrl's is model"),
    (["tokenizer_path=/models/q"], r"tokenizer_path: this is an AReaL key; relayrl's is model"),
    (["actor.path=/models/q"], r"actor\.path: .* relayrl's is model"),
    (["train_dataset.path=train.jsonl"], r"relayrl's is data\.train"),
    (["valid_dataset.path=eval.jsonl"], r"relayrl's is data\.eval"),
    (["gconfig.n_samples=4"], r"relayrl's is rollout\.group_size"),
    (["rollout.max_head_offpolicyness=2"], r"relayrl's is rollout\.max_staleness"),
    (["total_train_steps=10"], r"relayrl's is train\.total_steps"),
    (["rollout.fileroot=/dumps"], r"rollout\.fileroot: relayrl's key is rollout\.dump_root"),
    (["rollout.openai.mode=inline", "rollout.agent.mode=subprocess"],
     r"rollout\.openai\.mode and rollout\.agent\.mode are one setting"),
    (["scheduler.type=local", "launcher=ray"], r"scheduler\.type and launcher are one setting"),
    (["rollout.dump_to_file=true", "rollout.dump_root=/d"],
     r"set only rollout\.dump_root"),
    (["rollout.openai.mode=threads"],
     r"rollout\.openai\.mode \(relayrl's rollout\.agent\.mode\): expected one of 'inline', "
     r"'subprocess'"),
    (["scheduler.type=slurm"], r"scheduler\.type \(relayrl's launcher\): expected one of "
                               r"'local', 'ray', got 'slurm'"),
    (["rollout.openai.export_style=individual"],
     r"rollout\.openai\.export_style: unknown key \(relayrl's agent settings are under "
     r"rollout\.agent\)"),
    (["rollout.dump_to_file=sometimes"], r"rollout\.dump_to_file: expected bool"),
])
def test_other_areal_keys_are_refused_naming_relayrls_key(overrides: list[str],
                                                          message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(RelayConfig, None, overrides)


def test_every_key_named_as_relayrls_equivalent_exists() -> None:
    keys = set(_dotted(to_dict(RelayConfig())))
    for relay_key in [*AREAL_RENAMED.values(), *(v.split(" ")[0] for v in AREAL_REFUSED.values())]:
        assert relay_key in keys, relay_key


def _dotted(data: dict[str, object], prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        out.append(prefix + key)
        if isinstance(value, dict):
            out += _dotted(value, prefix + key + ".")  # type: ignore[arg-type]
    return out
