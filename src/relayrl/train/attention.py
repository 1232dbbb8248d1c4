"""The actor's CPU attention: transformers' SDPA, with grouped key/value heads kept grouped.

transformers hands SDPA grouped-query keys and values as they are (`enable_gqa`) only when no
mask is given; with a mask (a shared prefix's suffixes attend to its cache, which needs one) it
first copies each key/value head once per query head it serves, and the backward sums the
copies. SmolLM2 has 3 key/value heads for 9 query heads: on the actor's shapes (16 rows x 192
tokens attending to 505, bf16, one thread) torch's CPU flash kernel takes 0.088 s for one
layer's forward and backward with `enable_gqa` against 0.12-0.13 s through the copies, with the
same output and gradients up to the order of a bf16 sum (measured 2026-11-25). CUDA's flash
kernels take no mask with `enable_gqa`, so the GPU keeps transformers' own path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

GQA_SDPA = "relayrl_sdpa_gqa"
"""The name the attention function is registered under with transformers."""


def sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
             scaling: float | None = None, is_causal: bool | None = None,
             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: SDPA with `enable_gqa`, mask or not."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_length:  # as transformers does: a prefill into an empty static cache
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                         enable_gqa=_grouped(query, key))
    return out.transpose(1, 2).contiguous(), None


def _grouped(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether query heads share key/value heads, as a plain bool.

    In compiled layers whose module ints are graph inputs (`Actor` with `train.compile` and
    shared prefixes) the head counts are symbolic, and SDPA's `enable_gqa` takes no symbolic
    bool (a graph break per layer); branching on it makes dynamo settle it with a guard.
    """
    return True if query.shape[1] != key.shape[1] else False  # noqa: SIM210


def register() -> None:
    """Make `GQA_SDPA` an `attn_implementation` transformers knows (masks built as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GQA_SDPA, sdpa_gqa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_SDPA, sdpa_mask)


def resolve(attn_implementation: str, device: torch.device) -> str:
    """The implementation to load: "sdpa" on CPU becomes `GQA_SDPA`; anything else is kept."""
    if attn_implementation == "sdpa" and device.type == "cpu":
        register()
        return GQA_SDPA
    return attn_implementation
