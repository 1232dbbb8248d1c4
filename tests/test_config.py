"""Config loading: YAML plus dotted overrides, strict keys and types, errors that name the key."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from relayrl.config import (
    RelayConfig,
    TrainConfig,
    apply_overrides,
    dump_config,
    load_config,
    to_dict,
)
from relayrl.errors import ConfigError


@dataclass(frozen=True)
class Inner:
    ratio: float = 0.5
    tags: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Outer:
    name: str = "x"
    count: int = 1
    flag: bool = False
    limit: int | None = None
    mode: Literal["a", "b"] = "a"
    pair: tuple[int, int] = (1, 2)
    inner: Inner = field(default_factory=Inner)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def write_yaml_dict(tmp_path: Path, data: dict[str, object]) -> Path:
    return write(tmp_path, yaml.safe_dump(data))


def test_yaml_then_overrides_build_nested_dataclasses(tmp_path: Path) -> None:
    path = write(tmp_path, "name: run\ninner:\n  ratio: 0.25\n  tags: [p, q]\ncount: 3\n")
    cfg = load_config(Outer, path, ["count=7", "inner.tags=[z]", "limit=4"])
    assert cfg == Outer(name="run", count=7, limit=4, inner=Inner(ratio=0.25, tags=["z"]))


def test_relay_config_composes_components_and_places_outputs_by_experiment_and_trial(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "experiment_name: exp\ntrain:\n  lr: 2.0e-6\n")
    cfg = load_config(RelayConfig, path, ["rollout.group_size=4", "train.lr=1e-5",
                                          "gateway.port=9001", f"fileroot={tmp_path}"])
    assert cfg.rollout.group_size == 4
    assert cfg.train.lr == pytest.approx(1e-5)
    assert cfg.gateway.port == 9001
    assert cfg.run_dir == tmp_path / "exp" / "trial0"
    assert cfg.checkpoint_dir == tmp_path / "exp" / "trial0" / "checkpoints"
    assert cfg.gateway_config().model == cfg.model


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=1e-6", "train.lrr: unknown key (did you mean train.lr?)"),
        ("rollout.group_size=eight", "rollout.group_size: expected int, got 'eight'"),
        ("rollout.group_size=2.5", "rollout.group_size: expected int, got '2.5'"),
        ("train.drop_uniform_groups=1", "train.drop_uniform_groups: expected bool, got '1'"),
        ("train.loss_agg=tok", "train.loss_agg: expected one of 'token'"),
        ("train.betas=[0.9]", "train.betas: expected tuple[float, float]"),
        ("train.lr=-1", "train: lr must be > 0"),
        ("rollout.group_size=0", "rollout: group_size and batch_size must be >= 1"),
        ("sft.epochs=0", "sft: epochs and rows_per_step must be >= 1"),
        ("eval.every=-1", "eval: every must be >= 0"),
        ("eval.sampled=-2", "eval: sampled must be >= 0"),
        ("nonsense=1", "nonsense: unknown key (known: "),
        ("train", "expected dotted.key=value"),
    ],
)
def test_bad_overrides_raise_config_errors_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(RelayConfig, None, [override])
    assert message in str(info.value)


def test_unknown_key_in_yaml_is_an_error_with_its_dotted_path(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  eps_clip_hgh: 0.3\n")
    with pytest.raises(ConfigError, match=r"train\.eps_clip_hgh: unknown key \(did you mean "
                                          r"train\.eps_clip_high\?\)"):
        load_config(RelayConfig, path)


def test_values_are_typed_from_text_int_widens_to_float_and_bool_is_strict(tmp_path: Path) -> None:
    cfg = load_config(TrainConfig, None, ["lr=1", "grad_clip=0.5", "bf16=false",
                                          "behav_weight_cap=3", "betas=[0.8, 0.95]"])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.bf16 is False
    assert cfg.behav_weight_cap == 3.0
    assert cfg.betas == (0.8, 0.95)
    assert load_config(TrainConfig, None, ["bf16=auto"]).bf16 == "auto"
    with pytest.raises(ConfigError, match="lr: expected float, got True"):
        load_config(TrainConfig, write_yaml_dict(tmp_path, {"lr": True}))


def test_str_fields_take_override_text_verbatim_and_optional_takes_null() -> None:
    cfg = load_config(Outer, None, ["name=123", "limit=null"])
    assert cfg.name == "123"
    assert cfg.limit is None
    assert load_config(Outer, None, ["name=yes"]).name == "yes"


def test_yaml_float_without_dot_is_accepted_for_float_fields(tmp_path: Path) -> None:
    # PyYAML reads 1e-6 as a string (YAML 1.1); a float field must still take it.
    path = write(tmp_path, "lr: 1e-6\n")
    assert load_config(TrainConfig, path).lr == pytest.approx(1e-6)


def test_nested_type_errors_name_the_innermost_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"inner\.tags\[1\]: expected str, got 3"):
        load_config(Outer, write_yaml_dict(tmp_path, {"inner": {"tags": ["a", 3]}}))
    with pytest.raises(ConfigError, match=r"count\.x: count is a value, not a section"):
        load_config(Outer, write_yaml_dict(tmp_path, {"count": 2}), ["count.x=1"])


def test_apply_overrides_returns_a_changed_copy_and_leaves_the_original() -> None:
    base = RelayConfig()
    changed = apply_overrides(base, ["train.kl_coef=0.05", "eval.every=10"])
    assert changed.train.kl_coef == pytest.approx(0.05)
    assert changed.eval.every == 10
    assert base.train.kl_coef == 0.0
    assert changed.rollout == base.rollout


def test_dumped_config_loads_back_equal(tmp_path: Path) -> None:
    cfg = apply_overrides(RelayConfig(), ["train.betas=[0.8, 0.9]", "rollout.epochs=3"])
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(RelayConfig, tmp_path / "config.yaml") == cfg
    assert to_dict(cfg)["train"]["betas"] == [0.8, 0.9]


def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(RelayConfig, write(tmp_path, "- a\n- b\n"))


def test_the_seeds_subproc_spelling_is_the_subprocess_mode() -> None:
    from relayrl.config import RelayConfig, load_config
    from relayrl.workflow import AgentMode

    cfg = load_config(RelayConfig, None, ["rollout.agent.mode=subproc"])
    assert cfg.rollout.agent.mode is AgentMode.SUBPROCESS


def test_overrides_nested_under_a_free_form_field_are_parsed() -> None:
    from relayrl.config import RelayConfig, load_config

    cfg = load_config(RelayConfig, None, ["workflow_kwargs.sampling.top_p=0.5",
                                          "workflow_kwargs.sampling.stop=[a, b]"])
    assert cfg.workflow_kwargs == {"sampling": {"top_p": 0.5, "stop": ["a", "b"]}}


@pytest.mark.parametrize(("old", "new"), [
    ("gateway.model=x", "set model instead"),
    ("gateway.engine=vllm", "set engine.kind instead"),
    ("gateway.engine_url=http://127.0.0.1:9", "set engine.url instead"),
    ("gateway.max_staleness=2", "set rollout.max_staleness instead"),
    ("gateway.batch_size=4", "set rollout.batch_size instead"),
])
def test_a_runs_gateway_section_refuses_what_is_set_elsewhere(old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{old.split('=')[0]}: {new}"):
        load_config(RelayConfig, None, [old])


def test_a_gateways_own_config_still_takes_its_model_and_staleness() -> None:
    from relayrl.gateway.config import GatewayConfig

    cfg = load_config(GatewayConfig, None, ["model=x", "engine=fake", "max_staleness=2"])
    assert (cfg.model, cfg.engine, cfg.max_staleness) == ("x", "fake", 2)


def test_removed_options_are_refused_as_removed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.stratify_by: this option was removed"):
        load_config(RelayConfig, write(tmp_path, "rollout: {stratify_by: form}\n"))
    with pytest.raises(ConfigError, match=r"train\.bf16_mode: this option was removed"):
        load_config(RelayConfig, None, ["train.bf16_mode=copy"])
