"""`PPOTrainer`, the class a training script uses: `from relayrl import PPOTrainer`.

```python
config = config_from_args(sys.argv[1:])           # --config cfg.yaml key=value ...
with PPOTrainer(config, train_dataset=load_dataset(config.data.train)) as trainer:
    trainer.train(workflow="my_agent.MathAgent")
```

It takes the whole run's `RelayConfig` and starts what serves the policy itself (as
`relayrl train` does, through `relayrl.launch.run.train`): no launcher to build. The training
loop is `relayrl.train.trainer.PPOTrainer`, which takes a launcher and may be used directly.

The `with` block bounds the trainer: the engine, gateway and sessions a `train` call starts are
stopped before it returns, and a trainer whose block has ended refuses to train again.

Imports: config, train (records), launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from relayrl.config import RelayConfig
from relayrl.errors import ConfigError
from relayrl.launch import run
from relayrl.train.trainer import TrainResult, load_dataset

Dataset = Iterable[Mapping[str, Any]] | str | Path
"""Data items: a list of dicts, anything iterating over dicts (a Hugging Face `datasets.Dataset`),
a `pyarrow.Table`, or a JSONL/Parquet file."""


def as_items(dataset: Any, what: str) -> list[dict[str, Any]]:
    """`dataset` as a list of plain dicts; ConfigError naming `what` when it is none."""
    if isinstance(dataset, str | Path):
        return load_dataset(dataset)
    if isinstance(dataset, Mapping):  # e.g. a `datasets.DatasetDict`: which split is meant?
        splits = ", ".join(repr(k) for k in list(dataset)[:5])
        raise ConfigError(f"{what}: got a mapping of {type(dataset).__name__} (keys {splits}); "
                          f"pass one split, e.g. {what}=ds['train']")
    # `datasets.Dataset.to_list`, `pyarrow.Table.to_pylist`: all rows at once, as dicts
    to_list = getattr(dataset, "to_list", None) or getattr(dataset, "to_pylist", None)
    try:
        items = list(to_list() if callable(to_list) else dataset)
    except TypeError:
        raise ConfigError(f"{what}: expected a list of dicts (or a datasets.Dataset), got "
                          f"{type(dataset).__name__}") from None
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ConfigError(f"{what}[{i}]: expected a dict (one data item), got "
                              f"{type(item).__name__}")
    return [dict(item) for item in items]


class PPOTrainer:
    """Trains an agent or workflow with RL on `train_dataset`, by the run's `config`.

    `train_dataset` / `eval_dataset` default to the files `config.data.train` / `data.eval`
    name; `valid_dataset` is accepted as another name of `eval_dataset`.
    """

    def __init__(self, config: RelayConfig, train_dataset: Dataset | None = None,
                 eval_dataset: Dataset | None = None, *,
                 valid_dataset: Dataset | None = None) -> None:
        if not isinstance(config, RelayConfig):
            raise ConfigError(f"config: expected a RelayConfig (relayrl.config_from_args or "
                              f"relayrl.config.load_config make one), got "
                              f"{type(config).__name__}")
        if valid_dataset is not None and eval_dataset is not None:
            raise ConfigError("eval_dataset and valid_dataset name the same dataset: pass one")
        if eval_dataset is None:
            eval_dataset = valid_dataset
        self.config = config
        if train_dataset is None:
            if not config.data.train:
                raise ConfigError("train_dataset: none given, and the config names no "
                                  "data.train file")
            train_dataset = config.data.train
        self.train_dataset = as_items(train_dataset, "train_dataset")
        if not self.train_dataset:
            raise ConfigError("train_dataset is empty")
        if eval_dataset is None and config.data.eval:
            eval_dataset = config.data.eval
        self.eval_dataset = (as_items(eval_dataset, "eval_dataset")
                             if eval_dataset is not None else None)
        self.result: TrainResult | None = None
        """What the last `train` produced (checkpoint, evals, metrics path)."""
        self._closed = False

    def __enter__(self) -> PPOTrainer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """End the trainer: later `train` calls are refused (each call stops its own services)."""
        self._closed = True

    def train(self, workflow: Any = None, workflow_kwargs: dict[str, Any] | None = None, *,
              eval_workflow: Any = None,
              eval_workflow_kwargs: dict[str, Any] | None = None) -> TrainResult:
        """Train `workflow`: a dotted path ("my_agent.MathAgent"), a class, or an instance.

        An agent (anything with `async def run(data, **kwargs)`) or a `RolloutWorkflow`. Without
        one, the config's `workflow`; kwargs default to the config's `workflow_kwargs` (and
        `eval.workflow_kwargs` for the held-out evals, which run the same workflow).
        """
        if self._closed:
            raise ConfigError("this PPOTrainer is closed (its `with` block ended); make a new one")
        cfg = self.config
        if workflow is None:
            workflow = cfg.workflow
            if not workflow:
                raise ConfigError("workflow: pass trainer.train(workflow=...) or set `workflow` "
                                  "in the config, e.g. my_agent.MathAgent")
        if eval_workflow is not None and eval_workflow is not workflow:
            raise ConfigError("eval_workflow: the held-out evals run the training workflow; "
                              "give them other settings with eval_workflow_kwargs")
        if workflow_kwargs is None:
            workflow_kwargs = dict(cfg.workflow_kwargs) or None
        if eval_workflow_kwargs is None:
            eval_workflow_kwargs = dict(cfg.eval.workflow_kwargs) or None
        self.result = run.train(cfg, self.train_dataset, self.eval_dataset, workflow=workflow,
                                workflow_kwargs=workflow_kwargs,
                                eval_workflow_kwargs=eval_workflow_kwargs)
        return self.result


__all__ = ["PPOTrainer", "as_items"]
