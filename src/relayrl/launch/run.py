"""Running a training job from a config: `relayrl train CONFIG [overrides]` and `train(...)`.

Imports: config, train, launch.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.config import RelayConfig, dump_config, load_config
from relayrl.errors import ConfigError
from relayrl.launch.distributed import in_worker, launch_workers
from relayrl.launch.local import LocalLauncher
from relayrl.launch.process import add_import_path, keep_freed_heap
from relayrl.train.distributed import rank_device
from relayrl.train.ports import Launcher
from relayrl.train.trainer import PPOTrainer, TrainResult, load_dataset


def make_launcher(config: RelayConfig) -> Launcher:
    """The launcher `config.launcher` names: `local` (this process) or `ray` (Ray actors)."""
    if config.launcher == "ray":
        from relayrl.launch.ray import RayLauncher  # Ray is an optional extra

        return RayLauncher(config)
    return LocalLauncher(config)


def train(config: RelayConfig, train_dataset: Sequence[dict[str, Any]],
          eval_dataset: Sequence[dict[str, Any]] | None = None, *, workflow: Any,
          workflow_kwargs: dict[str, Any] | None = None,
          eval_workflow_kwargs: dict[str, Any] | None = None) -> TrainResult:
    """Train `workflow` on the datasets; services placed by `config.launcher` (default: here).

    With `train.world_size` > 1, starts that many trainer ranks on this machine, each running
    this function (rank 0 also runs the engine, gateway and rollouts); returns rank 0's result.
    """
    if config.train.world_size > 1 and not in_worker():
        rank_device(config.train.world_size - 1)  # one GPU per rank: refused before any starts
        return launch_workers(config.train.world_size, train, config, train_dataset,
                              eval_dataset, workflow=workflow, workflow_kwargs=workflow_kwargs,
                              eval_workflow_kwargs=eval_workflow_kwargs)
    if config.train.keep_heap:
        keep_freed_heap()
    if int(os.environ.get("RANK", "0")) == 0:
        dump_config(config, config.run_dir / "config.yaml")
    trainer = PPOTrainer(config, train_dataset, eval_dataset, launcher=make_launcher(config))
    return trainer.train(workflow, workflow_kwargs, eval_workflow_kwargs)


def run_from_config(path: str | Path, overrides: Sequence[str] = ()) -> TrainResult:
    """`relayrl train CONFIG [overrides]`: load the config and datasets, then train."""
    cfg = load_config(RelayConfig, path, overrides)
    add_import_path(Path(path).parent)  # agents named relative to the config import from there
    if not cfg.data.train:
        raise ConfigError("data.train: a training dataset (JSONL or Parquet) is required")
    if not cfg.workflow:
        raise ConfigError("workflow: name the agent or workflow to train, e.g. my_agent.MathAgent")
    return train(cfg, load_dataset(cfg.data.train),
                 load_dataset(cfg.data.eval) if cfg.data.eval else None,
                 workflow=cfg.workflow, workflow_kwargs=cfg.workflow_kwargs,
                 eval_workflow_kwargs=cfg.eval.workflow_kwargs or None)
