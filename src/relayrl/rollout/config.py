"""`RolloutConfig`: how the rollout controller runs episodes and batches them (one line a field)."""

from __future__ import annotations

from dataclasses import dataclass

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
    mode: str = "inline"                 # agents: "inline" coroutine or "subprocess" worker pool
    subproc_max_workers: int = 4         # worker processes in subprocess mode
    export_style: str = "concat"         # agents: "concat" (row per segment path) or "individual"
    credit: str = "discount"             # agents: credit rule applied at export
    discount: float = 1.0                # agents: γ of the discount rule
    capacity_wait_s: float = 60.0        # agents: wait this long for gateway capacity, then abort
    shuffle: bool = True                 # shuffle the dataset each epoch
    seed: int = 0                        # shuffling seed (epoch e uses seed + e)
    epochs: int | None = None            # passes over the dataset; None cycles forever
    is_eval: bool = False                # episodes see is_eval; stats and dumps go to eval-rollout
    dump_root: str | None = None         # fileroot of trajectory dumps; None writes none
    experiment: str = "default"          # dump path component
    trial: str = "trial0"                # dump path component
    progress: bool = True                # show a tqdm progress bar on stderr

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.batch_size < 1:
            raise ConfigError("group_size and batch_size must be >= 1")
        if self.max_concurrent_rollouts < self.group_size:
            raise ConfigError(f"max_concurrent_rollouts ({self.max_concurrent_rollouts}) must "
                              f"be >= group_size ({self.group_size}): a group starts at once")
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.episode_timeout_s <= 0:
            raise ConfigError(f"episode_timeout_s must be > 0, got {self.episode_timeout_s}")
        if self.epochs is not None and self.epochs < 1:
            raise ConfigError(f"epochs must be >= 1 or None, got {self.epochs}")
        self.agent_config()  # checks mode, export style and credit rule

    def agent_config(self) -> AgentConfig:
        """The settings `AgentWorkflow` takes from this config."""
        return AgentConfig(mode=self.mode, subproc_max_workers=self.subproc_max_workers,
                           export_style=self.export_style, credit=self.credit,
                           discount=self.discount, capacity_wait_s=self.capacity_wait_s,
                           http_timeout_s=self.episode_timeout_s)
