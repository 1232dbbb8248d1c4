"""Trainer settings: how the actor updates the policy (`TrainConfig`), held-out evaluation
(`EvalConfig`), the datasets (`DataConfig`) and the supervised warm-start (`SFTConfig`).

One dataclass per concern, one line per field with its default and meaning. Range checks sit in
`__post_init__`, next to the fields they guard. Imports: errors only (the generic YAML loader and
the composition of a whole run live in `relayrl.config`, above every layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from relayrl.errors import ConfigError

LossAgg = Literal["token", "seq-mean-token-mean", "seq-mean-token-sum"]
OffPolicy = Literal["decoupled", "tis", "none"]


@dataclass(frozen=True)
class TrainConfig:
    """How the actor updates the policy (one optimizer step per `Actor.update`)."""

    lr: float = 1e-6                          # AdamW learning rate (after warm-up)
    warmup_steps: int = 0                     # linear warm-up from 0 over this many steps
    weight_decay: float = 0.0                 # AdamW decoupled weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW moment decays
    adam_eps: float = 1e-8                    # AdamW denominator epsilon
    grad_clip: float = 1.0                    # max global grad norm; 0 turns clipping off
    micro_batch_tokens: int = 4096            # token budget of one forward/backward (rows x padded length)
    packing: Literal["unpad", "pad", "pack"] = "unpad"  # unpad: rows end to end, padded only inside attention (needs attn_implementation sdpa); pad: rows of similar length, padded; pack: rows concatenated, block-diagonal mask (flash-attention GPUs)
    bf16: bool | Literal["auto"] = "auto"     # bf16 compute (fwd/bwd on a bf16 copy of the fp32 weights, refreshed after each step); auto = on where the CPU has AMX/AVX512-BF16 or the GPU has bf16
    compile: bool = False                     # torch.compile the decoder layers (dynamic shapes); the first step compiles (~1 min on 2 cores)
    length_bucket: int = 64                   # pad, unpad: micro-batch lengths round up to a multiple of this (stable shapes); 1 = no rounding
    share_prefix: bool = True                 # pad, unpad: rows that start alike (one system prompt, one question) run their common prefix once
    attn_implementation: str = "sdpa"         # transformers attention kernel; on CPU "sdpa" keeps grouped KV heads grouped (train/attention.py); "flash_attention_2" suits packing on GPUs
    total_steps: int = 100                    # optimizer steps in the run
    minibatches: int = 1                      # optimizer steps per rollout batch, each on a part of its rows against the batch's proximal logprobs (>1 makes the PPO clip bite); step and version count batches
    eps_clip_low: float = 0.2                 # ratio may fall to 1 - this before the clip stops the gradient
    eps_clip_high: float = 0.28               # ratio may rise to 1 + this (DAPO's clip-higher keeps exploring)
    kl_coef: float = 0.0                      # weight of the k3 KL to the model as loaded; 0 loads no reference
    sft_replay_coef: float = 0.0              # weight of an SFT loss on `sft_replay_rows` warm-up traces added to every RL step (PPO-ptx); 0 = off
    sft_replay_rows: int = 4                  # warm-up traces drawn for each RL step's SFT loss (with sft_replay_coef > 0)
    loss_agg: LossAgg = "token"               # token: mean over all trained tokens; seq-mean-*: mean over rows
    off_policy: OffPolicy = "decoupled"       # correction for tokens sampled by older weights
    tis_cap: float = 2.0                      # tis: importance weights above this are truncated to it
    behav_weight_cap: float | None = None     # decoupled: tokens whose weight exceeds this are dropped
    drop_uniform_groups: bool = True          # drop groups whose episodes all got one reward (no signal)
    adv_norm: Literal["std", "mean"] = "std"  # std: (r - mean) / std within a group; mean: r - mean only
    advantage_source: Literal["group", "turn"] = "group"  # episode reward, or per-turn returns
    fp32_logits: bool = True                  # compute logits in fp32 even under bf16 (halves the logprob error)
    checkpoint_every: int = 50                # save every N steps; 0 saves only at the end
    keep_checkpoints: int = 2                 # keep the newest K checkpoints (0 keeps all)
    save_optimizer: bool = True               # write optimizer.pt so a run can resume exactly
    world_size: int = 1                       # data-parallel trainer ranks (torch.distributed; rank 0 serves rollouts)
    num_threads: int | None = None            # torch threads of SFT and RL updates; None: all cores for SFT, the cores an in-process engine leaves for RL
    lend_engine_cores: bool = True            # with num_threads None: an RL update also takes an in-process engine's cores once no rollout runs
    lora_rank: int = 0                        # >0: train rank-r LoRA adapters (peft) on lora_targets instead of every weight; the engine and checkpoints get the merged weights
    lora_alpha: float = 32.0                  # adapter scale: alpha / rank times B @ A
    lora_targets: str | tuple[str, ...] = "all-linear"  # modules that get adapters: peft's target_modules (all-linear: every linear layer but the output head)
    gradient_checkpointing: bool = False      # keep only each decoder layer's input for the backward and run the layer again there: activations' memory for ~1/3 more compute
    freeze_layers: int = 0                    # the embeddings (and a head tied to them) and the first N decoder layers stay as loaded: the backward stops above them; 0 trains every layer
    keep_heap: bool = True                    # glibc: the process keeps what an update frees for the next one (one arena, no trim, no mmap; relayrl/heap.py)

    def __post_init__(self) -> None:
        positive = ("lr", "micro_batch_tokens", "total_steps", "minibatches", "tis_cap",
                    "world_size", "length_bucket", "sft_replay_rows")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        non_negative = ("warmup_steps", "weight_decay", "grad_clip", "eps_clip_low",
                        "eps_clip_high", "kl_coef", "checkpoint_every", "keep_checkpoints",
                        "sft_replay_coef")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1 or null, got {self.num_threads}")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eps_clip_low >= 1:
            raise ConfigError(f"eps_clip_low must be < 1, got {self.eps_clip_low}")
        if self.packing == "unpad" and self.attn_implementation != "sdpa":
            # only relayrl's SDPA function knows where an unpadded micro-batch's rows are
            raise ConfigError(f"packing=unpad needs attn_implementation=sdpa, got "
                              f"{self.attn_implementation!r} (use packing=pad or pack)")
        if self.lora_rank < 0 or self.lora_alpha <= 0:
            raise ConfigError(f"lora_rank must be >= 0 and lora_alpha > 0, got "
                              f"{self.lora_rank} and {self.lora_alpha}")
        if self.lora_rank and self.compile:
            # compiled layers around peft's adapter modules have never been run
            raise ConfigError("lora_rank with compile is not supported: set compile: false")
        if self.gradient_checkpointing and self.compile:
            # checkpointed layers inside compiled ones have never been run
            raise ConfigError("gradient_checkpointing with compile is not supported: set compile: false")
        if self.freeze_layers < 0:
            raise ConfigError(f"freeze_layers must be >= 0, got {self.freeze_layers}")
        if self.freeze_layers and self.lora_rank:
            # adapters already leave every base weight frozen; which layers get them is lora_targets
            raise ConfigError("freeze_layers with lora_rank is not supported: set one of them to 0")
        if self.behav_weight_cap is not None and self.behav_weight_cap <= 0:
            raise ConfigError(f"behav_weight_cap must be > 0 or null, got {self.behav_weight_cap}")


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation before and after RL (one episode per item, no training)."""

    every: int = 0                            # also evaluate every N training steps (the last by the eval after RL); 0 = never
    max_items: int | None = None              # evaluate on at most this many data items; None = all
    base: bool = False                        # also evaluate the model as loaded, before the SFT warm-start
    max_concurrent: int | None = None         # held-out episodes run at once; None = rollout.max_concurrent_rollouts
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)  # agent kwargs for eval (e.g. temperature 0)
    sampled: int = 0                          # also run each item this many times with the training workflow_kwargs, before and after RL; 0 = off

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"every must be >= 0, got {self.every}")
        if self.sampled < 0:
            raise ConfigError(f"sampled must be >= 0, got {self.sampled}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ConfigError(f"max_concurrent must be >= 1 or null, got {self.max_concurrent}")


@dataclass(frozen=True)
class DataConfig:
    """Datasets: JSONL or Parquet files of items such as `{"messages": [...], "answer": "35"}`."""

    train: str | None = None                  # training items
    eval: str | None = None                   # held-out items (evaluated before and after RL)


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-start on recorded rows before RL (no data = no SFT stage)."""

    data: str | None = None                   # rows to imitate: relayrl JSONL rows, or ATIF trajectories (a .json file or a folder of them)
    epochs: int = 1                           # passes over the rows
    rows_per_step: int = 8                    # rows per optimizer step
    lr: float = 1e-4                          # learning rate of the warm-start (constant)
    max_rows: int | None = None               # use at most this many rows; None = all

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.rows_per_step < 1:
            raise ConfigError("epochs and rows_per_step must be >= 1")
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0, got {self.lr}")
