"""`EngineConfig`: which inference engine serves the policy during training.

`local` runs the model in the trainer's process (the CPU default). `vllm` talks to a vLLM server
over HTTP: `url` names a running one; without a url the launcher starts a managed server from
the venv `scripts/install_vllm.sh` makes. New weights reach a remote engine as a checkpoint
directory it reloads. Imports: errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import ConfigError

TRAINING_ENGINES = ("local", "vllm", "sglang")
"""Engines that take new weights (the scripted fake engine is for the gateway's tests)."""


@dataclass(frozen=True)
class EngineConfig:
    """The engine a training run or a service uses."""

    kind: str = "local"                  # local (in-process), vllm or sglang (HTTP servers)
    url: str | None = None               # a running server's root; vllm without one: start a managed server
    num_threads: int | None = None       # local: torch threads of the engine thread (None: cores - 1)
    prefix_cache_mb: int = 512           # local: memory for finished sequences' KV, reused by prompts that start with them (0: off)
    max_prefill_tokens: int = 4096
    """local: prompt tokens prefilled in one pass between two decode steps; a longer prompt is
    prefilled in chunks of this many. Smaller chunks: sequences already decoding stall less while a
    long prompt (a coding CLI's first call) prefills; larger: that long prompt gets its own first
    token sooner, in fewer passes."""

    def __post_init__(self) -> None:
        if self.prefix_cache_mb < 0:
            raise ConfigError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")
        if self.max_prefill_tokens <= 0:
            raise ConfigError(f"max_prefill_tokens must be > 0, got {self.max_prefill_tokens}")
        if self.kind not in TRAINING_ENGINES:
            raise ConfigError(f"engine kind {self.kind!r} is not one of {list(TRAINING_ENGINES)}")
        if self.kind == "sglang" and not self.url:
            raise ConfigError("engine kind 'sglang' needs url: the server's root")
