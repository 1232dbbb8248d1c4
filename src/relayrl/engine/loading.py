"""`LocalEngine`'s set-up helpers: its dtype, context length, thread count, decode path in words,
and weights read from a checkpoint directory.

Imports: torch, transformers, relayrl.kernels (the core count), relayrl.models, errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from relayrl.engine.decoder import LeanDecoder
from relayrl.errors import InvalidRequest, ModelError
from relayrl.kernels import usable_cores
from relayrl.models import cpu_has_bf16_units


def default_num_threads() -> int:
    """Torch threads for the engine: the cores this process may use, less one, and at most torch's."""
    return max(1, min(torch.get_num_threads(), usable_cores() - 1))


def describe_decode_path(lean: LeanDecoder | None) -> str:
    """The decode path `lean` takes, in words."""
    if lean is None:
        return "through the model's forward"
    if lean.step_kernel is not None:
        path = f"as one compiled {lean.step_kernel.name} step per token"
        if lean.products_from is not None:
            path += (f"; from {lean.products_from} rows on, its products in oneDNN (AMX) "
                     "and the rest in compiled pieces")
        return path
    attention = "the compiled attention kernel" if lean.attention is not None else "torch's SDPA"
    return f"op by op in torch with {attention}"


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype for `dtype`; "auto" is bf16 where it is fast (bf16 units, bf16 GPU)."""
    if dtype != "auto":
        picked = getattr(torch, dtype, None)
        if not isinstance(picked, torch.dtype) or not picked.is_floating_point:
            raise InvalidRequest(f"unknown dtype {dtype!r}; use auto, float32 or bfloat16")
        return picked
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_bf16_units() else torch.float32


def model_context_length(config: Any, max_context: int | None) -> int:
    """The model's context (capped by a sliding window we do not apply, and by `max_context`)."""
    limits = [
        getattr(config, name, None)
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length")
    ]
    if getattr(config, "use_sliding_window", True):
        # Our 4D masks span the whole context: a window shorter than it would be ignored.
        limits.append(getattr(config, "sliding_window", None))
    limits.append(max_context)
    known = [int(x) for x in limits if isinstance(x, int) and x > 0]
    if not known:
        raise ModelError("the model config names no context length: pass max_context")
    return min(known)


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The state dict stored in a Hugging Face checkpoint directory."""
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidRequest(f"checkpoint {path!r} is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        return state
    # Other formats (.bin shards, GGUF): let transformers read them the ordinary way.
    return dict(AutoModelForCausalLM.from_pretrained(path).state_dict())
