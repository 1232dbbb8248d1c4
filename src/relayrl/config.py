"""Configuration: `RelayConfig` composes one dataclass per component, loaded from YAML with
dotted command-line overrides (`relayrl train cfg.yaml rollout.group_size=8 train.lr=1e-6`).

The loader is generic: `load_config(cls, path, overrides)` builds any dataclass from its type
hints, so each component keeps its config next to its code (`GatewayConfig` in gateway/,
`RolloutConfig` in rollout/, `TrainConfig` and friends in train/) and this module only composes
them into `RelayConfig`. It sits above every layer (it imports their configs); nothing below
`launch` imports it. Checking is strict: an
unknown key or a value of the wrong type is a `ConfigError` that names the dotted key, because a
misspelt hyperparameter that silently keeps its default wastes a whole run.

Tradeoff: values are checked against type hints only (int, float, bool, str, Optional/unions,
Literal, list, tuple, dict, nested dataclasses, Path, Enum); range checks live in each config's
`__post_init__`, next to the field they guard.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import yaml

from relayrl.engine.config import EngineConfig
from relayrl.errors import ConfigError
from relayrl.gateway.config import GatewayConfig
from relayrl.rollout.config import RolloutConfig
from relayrl.rollout.external import ExternalConfig
from relayrl.train.config import DataConfig, EvalConfig, SFTConfig, TrainConfig
from relayrl.workflow.agent import AgentMode

T = TypeVar("T")

MOVED_KEYS: dict[str, str] = {
    "gateway.model": "model",
    "gateway.engine": "engine.kind",
    "gateway.engine_url": "engine.url",
    "gateway.max_staleness": "rollout.max_staleness",
    "gateway.batch_size": "rollout.batch_size",
}
"""Keys of a run's config (`RelayConfig`) that are set in one place only: the gateway section's
copy -> the key that sets it. `relayrl gateway` alone still reads them from its own config."""

REMOVED_KEYS = frozenset({
    "rollout.stratify_by", "rollout.oversample_groups", "rollout.grow_uniform_groups",
    "rollout.baseline_by", "rollout.baseline_window", "rollout.baseline_min_gap",
    "train.kl_reference", "train.bf16_mode",
})
"""Options that are gone: a config that sets one is refused with a message saying so."""

@dataclass(frozen=True)
class RelayConfig:
    """A whole run. Logs and checkpoints go under `{fileroot}/{experiment_name}/{trial_name}/`."""

    experiment_name: str = "relayrl"          # groups trials of one experiment
    trial_name: str = "trial0"                # one run of the experiment
    fileroot: str = "runs"                    # root folder of all experiments' outputs
    seed: int = 1                             # seeds torch, random and the data order
    model: str = "smollm2-135m-instruct"      # policy: packaged name, local HF dir or hub id
    workflow: str | None = None               # agent or workflow to train, e.g. "my_agent.MathAgent"
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the agent's constructor
    launcher: Literal["local", "ray"] = "local"  # where services run: this process, or Ray actors/tasks
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    service: ExternalConfig = field(default_factory=ExternalConfig)  # `relayrl serve` only

    @property
    def run_dir(self) -> Path:
        """`{fileroot}/{experiment_name}/{trial_name}`: this trial's outputs."""
        return Path(self.fileroot) / self.experiment_name / self.trial_name

    @property
    def checkpoint_dir(self) -> Path:
        """Where `step_N` checkpoint directories go."""
        return self.run_dir / "checkpoints"

    @property
    def log_dir(self) -> Path:
        """Where TensorBoard events, metrics.jsonl and plots go."""
        return self.run_dir / "logs"

    def gateway_config(self) -> GatewayConfig:
        """The gateway's settings, serving this run's policy (the top-level `model`)."""
        return dataclasses.replace(self.gateway, model=self.model)


# -- loading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CliText:
    """An override's raw text: parsed as a YAML scalar, or kept as text for `str` fields."""

    text: str

    def __repr__(self) -> str:
        return repr(self.text)


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
# PyYAML follows YAML 1.1, which reads `1e-6` (no dot) as a string: accept such text for floats.


@overload
def config_from_args(argv: Sequence[str] | None = None, *,
                     prog: str | None = None) -> RelayConfig: ...
@overload
def config_from_args(argv: Sequence[str] | None, cls: type[T],
                     prog: str | None = None) -> T: ...
@overload
def config_from_args(argv: Sequence[str] | None = None, *, cls: type[T],
                     prog: str | None = None) -> T: ...
def config_from_args(argv: Sequence[str] | None = None, cls: type[Any] = RelayConfig,
                     prog: str | None = None) -> Any:
    """The config a script's command line names: `--config FILE` (optional) and `key=value`s.

    For scripts run as `python train.py --config cfg.yaml rollout.group_size=4`; `argv`
    defaults to `sys.argv[1:]`. A malformed command line exits with argparse's usage message.
    """
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=prog, description="Load a relayrl config: a YAML "
                                     "file and dotted key=value overrides.")
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
    args = parser.parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    return load_config(cls, args.config, args.overrides)


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build dataclass `cls` from a YAML file (optional) and dotted `key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level, "
                              f"got {type(loaded).__name__}")
        data = loaded or {}
    for item in overrides:
        _set_dotted(data, *parse_override(item))
    return from_dict(cls, data)


def apply_overrides(config: T, overrides: Sequence[str]) -> T:
    """A copy of dataclass instance `config` with dotted `key=value` overrides applied."""
    data = to_dict(config)
    for item in overrides:
        _set_dotted(data, *parse_override(item))
    return from_dict(type(config), data)


def parse_override(item: str) -> tuple[str, _CliText]:
    """Split `a.b=value` into the dotted key and the value's raw text."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected dotted.key=value")
    return key, _CliText(value.strip())


def to_dict(config: Any) -> dict[str, Any]:
    """A dataclass instance as plain YAML-ready values (tuples become lists, enums values)."""
    data = typing.cast(dict[str, Any], _plain(config))
    if isinstance(config, RelayConfig):  # set elsewhere in a run: see MOVED_KEYS
        for key in MOVED_KEYS:
            section, name = key.split(".")
            data[section].pop(name, None)
    return data


def dump_config(config: Any, path: str | Path) -> None:
    """Write a dataclass config as YAML (a run records the config it ran with)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking every key and value against the hints."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix or cls.__name__}: expected a mapping, got {data!r}")
    if cls is RelayConfig and not prefix:
        data = _from_areal_keys(data)
    fields = {f.name: f for f in dataclasses.fields(typing.cast(Any, cls)) if f.init}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if dotted in MOVED_KEYS and _root_is_run(cls, prefix):
            raise ConfigError(f"{dotted}: set {MOVED_KEYS[dotted]} instead (a run sets it in "
                              "one place)")
        if key not in fields and dotted in REMOVED_KEYS:
            raise ConfigError(f"{dotted}: this option was removed; delete it from the config")
        if key not in fields:
            raise ConfigError(f"{dotted}: unknown key{_suggest(str(key), fields, prefix)}")
        kwargs[key] = _convert(value, hints[key], dotted)
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in kwargs:
            raise ConfigError(f"{prefix + '.' if prefix else ''}{name}: required key missing")
    try:
        return cls(**kwargs)
    except ValueError as e:  # ConfigError from __post_init__ included: say which section
        raise ConfigError(f"{prefix}: {e}" if prefix else str(e)) from e


# -- keys of AReaL configs ---------------------------------------------------------------------
# Configs ported from AReaL keep working where relayrl has the same setting under another name
# (the key is rewritten), and fail naming relayrl's key where it does not (one edit, no guess).

AREAL_RENAMED: dict[str, str] = {
    "rollout.openai.mode": "rollout.agent.mode",
    "rollout.openai.subproc_max_workers": "rollout.agent.subproc_max_workers",
    "scheduler.type": "launcher",
}
"""AReaL keys accepted as the relayrl key they name (`rollout.dump_to_file` and
`rollout.fileroot` are accepted too: together they are `rollout.dump_root`)."""

AREAL_REFUSED: dict[str, str] = {
    "tokenizer_path": "model (the policy's own tokenizer is always used)",
    "rollout.tokenizer_path": "model (trajectory dumps are decoded with the policy's tokenizer)",
    "actor.path": "model",
    "cluster.fileroot": "fileroot",
    "train_dataset.path": "data.train",
    "valid_dataset.path": "data.eval",
    "train_dataset.batch_size": "rollout.batch_size (groups per step)",
    "gconfig.n_samples": "rollout.group_size",
    "gconfig.max_new_tokens": "workflow_kwargs (the agent sets max_tokens on its calls)",
    "gconfig.temperature": "workflow_kwargs (the agent sets temperature on its calls)",
    "rollout.max_head_offpolicyness": "rollout.max_staleness",
    "rollout.consumer_batch_size": "rollout.batch_size",
    "total_train_epochs": "rollout.epochs (and train.total_steps, which ends the run)",
    "total_train_steps": "train.total_steps",
    "actor.optimizer.lr": "train.lr",
}
"""AReaL keys with no relayrl spelling: refused with the relayrl key that does the job."""


def _from_areal_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` with AReaL's keys renamed to relayrl's; ConfigError for the ones relayrl lacks."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for key, relay_key in AREAL_REFUSED.items():
        if _lookup(out, key) is not _ABSENT:
            raise ConfigError(f"{key}: this is an AReaL key; relayrl's is {relay_key}")
    rollout = out.get("rollout")
    if isinstance(rollout, dict):
        openai = rollout.get("openai")
        if isinstance(openai, Mapping):
            extra = sorted(set(openai) - {"mode", "subproc_max_workers"})
            if extra:
                raise ConfigError(f"rollout.openai.{extra[0]}: unknown key (relayrl's agent "
                                  "settings are under rollout.agent)")
    for key, relay_key in AREAL_RENAMED.items():
        value = _lookup(out, key)
        if value is _ABSENT:
            continue
        if _lookup(out, relay_key) is not _ABSENT:
            raise ConfigError(f"{key} and {relay_key} are one setting (relayrl's name is "
                              f"{relay_key}): set only one")
        value = _convert(value, _AREAL_TYPES[key], f"{key} (relayrl's {relay_key})")
        _move(out, key, relay_key, value)
    rollout = out.get("rollout")  # (renaming copied the section)
    if isinstance(rollout, dict):
        _dump_settings(rollout, out.get("fileroot", RelayConfig.fileroot))
    return out


def _dump_settings(rollout: dict[str, Any], run_fileroot: Any) -> None:
    """AReaL's `dump_to_file` and `fileroot` in `rollout`, as relayrl's `dump_root`."""
    if "dump_to_file" not in rollout:
        if "fileroot" in rollout:
            raise ConfigError("rollout.fileroot: relayrl's key is rollout.dump_root (where "
                              "trajectory dumps go; setting it turns dumps on)")
        return
    if "dump_root" in rollout:
        raise ConfigError("rollout.dump_to_file and rollout.dump_root are one setting: "
                          "set only rollout.dump_root (relayrl's key)")
    dump = _convert(rollout.pop("dump_to_file"), bool, "rollout.dump_to_file")
    root = rollout.pop("fileroot", None)
    if dump:  # as in AReaL, dumps go under the run's fileroot unless rollout.fileroot says
        rollout["dump_root"] = run_fileroot if root is None else root


_ABSENT = object()
_AREAL_TYPES: dict[str, Any] = {
    "rollout.openai.mode": AgentMode,
    "rollout.openai.subproc_max_workers": int,
    "scheduler.type": Literal["local", "ray"],  # AReaL's slurm has no relayrl launcher
}


def _lookup(data: Mapping[str, Any], dotted: str) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _move(data: dict[str, Any], old: str, new: str, value: Any) -> None:
    *parents, leaf = old.split(".")
    node = data
    chain = []
    for part in parents:  # copy the sections on the way: the caller's mapping is not changed
        node[part] = dict(node[part])
        chain.append((node, part))
        node = node[part]
    del node[leaf]
    for parent, part in reversed(chain):  # sections left empty go (AReaL-only ones included)
        if not parent[part]:
            del parent[part]
    *parents, leaf = new.split(".")
    node = data
    for part in parents:
        node[part] = dict(node.get(part) or {})
        node = node[part]
    node[leaf] = value


def _root_is_run(cls: type, prefix: str) -> bool:
    """Whether `cls` at `prefix` is the gateway section of a run's config, not a gateway's own."""
    return prefix == "gateway" and cls is GatewayConfig


def _suggest(key: str, fields: Mapping[str, Any], prefix: str) -> str:
    close = difflib.get_close_matches(key, list(fields), n=1, cutoff=0.6)
    if not close:
        return f" (known: {', '.join(sorted(fields))})"
    return f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)"


def _set_dotted(data: dict[str, Any], key: str, value: _CliText) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"{key}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _convert(value: Any, tp: Any, key: str) -> Any:
    """`value` checked (and, where lossless, converted) against type `tp`; else ConfigError."""
    if isinstance(value, _CliText):
        return _convert_text(value.text, tp, key)
    ok, out = _try_convert(value, tp, key)
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return out


def _convert_text(text: str, tp: Any, key: str) -> Any:
    try:
        parsed = yaml.safe_load(text) if text else ""
    except yaml.YAMLError:
        parsed = text
    ok, out = _try_convert(parsed, tp, key)
    if ok:
        return out
    # `name=123` or `name=yes` for a str field: the text itself is the value.
    ok, out = _try_convert(text, tp, key)
    if ok:
        return out
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {text!r}")


def _try_convert(value: Any, tp: Any, key: str) -> tuple[bool, Any]:
    """(True, converted) when `value` fits `tp`; (False, None) otherwise.

    Nested dataclasses and containers raise ConfigError themselves so that the error names the
    innermost key.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return True, _untext(value)
    if origin is typing.Union or origin is types.UnionType:
        if value is None:
            return type(None) in args, None
        inner: ConfigError | None = None
        for arm in args:
            if arm is type(None):
                continue
            try:
                ok, out = _try_convert(value, arm, key)
            except ConfigError as e:  # an arm that fits in shape but not in detail
                inner = inner or e
                continue
            if ok:
                return True, out
        if inner is not None:
            raise inner
        return False, None
    if origin is Literal:
        return (value in args and any(type(value) is type(a) for a in args)), value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return True, value
        if not isinstance(value, Mapping):
            return False, None
        return True, from_dict(tp, value, key)
    if origin in (list, Sequence) or tp is list:
        if not isinstance(value, list | tuple):
            return False, None
        item = args[0] if args else Any
        return True, [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is tuple or tp is tuple:
        return _try_tuple(value, args, key)
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            return False, None
        kt, vt = args if args else (Any, Any)
        return True, {_convert(k, kt, key): _convert(v, vt, f"{key}.{k}") for k, v in value.items()}
    return _try_scalar(value, tp)


def _untext(value: Any) -> Any:
    """`value` with every override text inside it parsed as YAML (for fields typed `Any`)."""
    if isinstance(value, _CliText):
        try:
            return yaml.safe_load(value.text) if value.text else ""
        except yaml.YAMLError:
            return value.text
    if isinstance(value, Mapping):
        return {k: _untext(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_untext(v) for v in value)
    return value


def _try_tuple(value: Any, args: tuple[Any, ...], key: str) -> tuple[bool, Any]:
    if not isinstance(value, list | tuple):
        return False, None
    if len(args) == 2 and args[1] is Ellipsis:
        return True, tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if args and len(value) != len(args):
        return False, None
    items = args or (Any,) * len(value)
    return True, tuple(_convert(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, items, strict=True)))


def _try_scalar(value: Any, tp: Any) -> tuple[bool, Any]:
    if tp is bool:
        return isinstance(value, bool), value  # strict: 1 is not True
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return True, float(value)
        if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            return True, float(value)
        return False, None
    if tp is str:
        return isinstance(value, str), value
    if tp is type(None):
        return value is None, None
    if tp is Path:
        return isinstance(value, str | Path), Path(value) if isinstance(value, str | Path) else None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return True, tp(value)
        except ValueError:
            return False, None
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return False, None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if tp is type(None):
        return "None"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value
