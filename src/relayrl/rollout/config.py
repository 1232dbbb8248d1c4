"""`RolloutConfig`: how the rollout controller runs episodes and batches them (one line a field).

How each agent episode is run and exported (mode, workers, export style, credit rule, discount,
capacity wait) is the workflow's `AgentConfig`, held whole as the `agent` section
(`rollout.agent.export_style: concat` in YAML), not copied field by field.

May import: `relayrl.errors`, `relayrl.workflow.agent` (for `AgentConfig`); no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from relayrl.errors import ConfigError
from relayrl.workflow.agent import AgentConfig


@dataclass(frozen=True)
class RolloutConfig:
    """Rollout settings. Batches are counted in *groups* (data items), not episodes."""

    group_size: int = 8                  # episodes per data item; advantages are centred per group
    batch_size: int = 4                  # groups per training batch (rows: up to batch × group)
    max_concurrent_rollouts: int = 32    # episodes running at once (each holds a gateway session)
    max_staleness: int = 1               # admit while accepted+running groups <= (v+this+1)·batch
    episode_timeout_s: float = 600.0     # an episode running longer is aborted
    # the run stops with an error (RolloutFailed, naming the last episode's exception, where it
    # was raised, and the count) once this many episodes in a row have aborted (raised, timed
    # out, returned something malformed) with none finished or rejected in between; what was
    # recorded before (metrics, checkpoints, dumps) stays. None: never stop (not recommended)
    max_consecutive_aborts: int | None = 64
    # agents: mode, workers, export style, credit rule, discount, capacity wait (one section)
    agent: AgentConfig = field(default_factory=AgentConfig)
    shuffle: bool = True                 # shuffle the dataset each epoch
    seed: int | None = None              # shuffling seed (epoch e: seed + e); None: the run's seed
    epochs: int | None = None            # passes over the dataset; None cycles forever
    is_eval: bool = False                # episodes see is_eval; stats and dumps go to eval-rollout
    dump_root: str | None = None         # fileroot of trajectory dumps; None writes none
    # (the trainer's base-model eval and eval retries write none: they would replace files)
    experiment: str = "default"          # dump path component (a training run uses its experiment_name)
    trial: str = "trial0"                # dump path component (a training run uses its trial_name)
    progress: bool = True                # show a tqdm progress bar on stderr
    # dynamic sampling (as in DAPO): a group whose episodes all got one reward carries no GRPO
    # signal; it is set aside and another item sampled in its place. Off in eval.
    dynamic_sampling: bool = False
    dynamic_sampling_budget: int = 3     # per batch, at most this × batch_size groups set aside

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.batch_size < 1:
            raise ConfigError("group_size and batch_size must be >= 1")
        if self.max_concurrent_rollouts < self.group_size:
            raise ConfigError(f"max_concurrent_rollouts ({self.max_concurrent_rollouts}) must "
                              f"be >= group_size ({self.group_size}): a group starts at once")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_consecutive_aborts is not None and self.max_consecutive_aborts < 1:
            raise ConfigError(f"max_consecutive_aborts must be >= 1 or None, got "
                              f"{self.max_consecutive_aborts}")
        if self.episode_timeout_s <= 0:
            raise ConfigError(f"episode_timeout_s must be > 0, got {self.episode_timeout_s}")
        if self.dynamic_sampling_budget < 0:
            raise ConfigError(f"dynamic_sampling_budget must be >= 0, got "
                              f"{self.dynamic_sampling_budget}")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None, got {self.epochs}")
        default_http = AgentConfig.http_timeout_s
        if self.agent.http_timeout_s not in (default_http, self.episode_timeout_s):
            raise ConfigError("agent.http_timeout_s follows episode_timeout_s; set "
                              "episode_timeout_s instead")

    def agent_config(self) -> AgentConfig:
        """The settings `AgentWorkflow` takes: the `agent` section, HTTP timeout = episode timeout."""
        return replace(self.agent, http_timeout_s=self.episode_timeout_s)
