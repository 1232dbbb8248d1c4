"""RMSNorm, SwiGLU and the rotary embedding in one pass each, forward and backward, for the bf16
copy on CPU: `fuse`.

Llama-family layers write both as chains of small bf16 ops: RMSNorm is eight (a cast up, square,
mean, add, rsqrt, multiply, a cast down, the weight), SwiGLU two (silu, multiply), and autograd
adds as many again going back. On the main job's update each op is a pass over a [1728, 576] or
[1728, 1536] tensor; one pass each took 0.10-0.22 s off a 3.4 s update on two Zen 5 cores
(1.03-1.07x over three runs, benchmarks/RESULTS.md, "The update at half the bf16 peak"). The
kernels (kernels/csrc/train_kernels.c) read each input once and round where the bf16 ops round
(after the normalisation, after the weight; after silu, after the product), so outputs equal the
modules' own (bit-equal on the main job's shapes, measured; an exp or a sum a hair apart could
flip a rounding).

`fuse` replaces the `forward` of those modules of a model with one that takes the kernels for
contiguous bf16 CPU tensors (hidden size a multiple of 16) and calls the module's own forward for
anything else (and everything where the kernels are not built). The classes are
named, not guessed: an RMSNorm that adds one to its weight (Gemma) or an MLP with another
activation must not take these.

The rotary embedding is not a module: attention calls its modeling module's
`apply_rotary_pos_emb` (`q * cos + rotate_half(q) * sin`, five bf16 ops and a concatenation per
tensor, as many again going back). `fuse` wraps that function, for the whole process, with one
that takes the kernel for bf16 CPU tensors it takes and hands anything else to the original
(fp32, another head size or layout, compiled code, no kernels). Its outputs and gradients
equal the original's bit for bit (each element is one product or a sum of two, rounded as torch
rounds them; tested), so other callers in the process get the same numbers. 1.017x the update
(twelve interleaved rounds; the embedding's whole cost, measured by skipping it, was 1.018x).

Tradeoff: SwiGLU's backward recomputes silu(gate) instead of keeping it, one exp per element
against a third tensor of the MLP's widest shape kept per layer.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from relayrl.kernels import TrainKernels, train_kernels

NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
"""RMSNorms written as y = weight * bf16(x * rsqrt(mean(x^2) + eps)), computed in fp32."""

MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
"""MLPs written as down_proj(act_fn(gate_proj(x)) * up_proj(x))."""

ATTENTION_CLASSES = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention",
                               "MistralAttention"})
"""Attentions whose modeling module's `apply_rotary_pos_emb` is Llama's: `x * cos +
rotate_half(x) * sin`, rotate_half(x) = [-x2, x1], cos and sin unsqueezed at dim 1."""


def _kernels(*tensors: torch.Tensor) -> TrainKernels | None:
    """The kernels, where they are built and these tensors are what they take."""
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        return None
    return train_kernels()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float,
                kernels: TrainKernels) -> torch.Tensor:
        x = x.contiguous()
        y, r = kernels.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        ctx.kernels = kernels
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, r = ctx.saved_tensors
        dx, dw = ctx.kernels.rms_norm_grad(grad.contiguous(), x, weight, r)
        return (dx if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor,
                kernels: TrainKernels) -> torch.Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        ctx.save_for_backward(gate, up)
        ctx.kernels = kernels
        return kernels.swiglu(gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        d_gate, d_up = ctx.kernels.swiglu_grad(grad.contiguous(), gate, up)
        return d_gate, d_up, None


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kernels: TrainKernels) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.kernels, ctx.layout = kernels, (x.shape, x.stride())
        return kernels.rotary(x, cos, sin)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        # laid out as the input was (token-major for projections' outputs), as autograd's would be
        out = torch.empty_strided(*ctx.layout, dtype=grad.dtype)
        return ctx.kernels.rotary(grad, cos, sin, backward=True, out=out), None, None, None


def rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` (a modeling module's `apply_rotary_pos_emb`) taking the kernel for bf16 CPU
    tensors it takes (one pass forward and back, rounding as the original rounds), else itself."""
    if getattr(original, "relayrl_fused", False):
        return original

    @functools.wraps(original)
    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                             sin: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        kernels = None if torch.compiler.is_compiling() else _kernels(q, k, cos, sin)
        if (kernels is None or unsqueeze_dim != 1 or cos.requires_grad or sin.requires_grad
                or not (kernels.rotary_supports(q, cos, sin)
                        and kernels.rotary_supports(k, cos, sin))):
            return original(q, k, cos, sin, *args, **kwargs)
        return _Rotary.apply(q, cos, sin, kernels), _Rotary.apply(k, cos, sin, kernels)

    # a mark on the function object, read back with getattr (a second patch keeps the first)
    apply_rotary_pos_emb.relayrl_fused = True  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def rms_norm(module: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """`module`'s RMSNorm of `hidden_states`, in one pass where the kernels take them."""
    weight = module.weight
    kernels = _kernels(hidden_states, weight)
    if (kernels is None or hidden_states.shape[-1] % 16
            or weight.shape != hidden_states.shape[-1:]):
        return type(module).forward(module, hidden_states)
    return _RMSNorm.apply(hidden_states, weight, float(module.variance_epsilon), kernels)


def swiglu_mlp(module: Any, x: torch.Tensor) -> torch.Tensor:
    """`module`'s MLP of `x`, its silu(gate) * up in one pass where the kernels take them."""
    gate, up = module.gate_proj(x), module.up_proj(x)
    kernels = _kernels(gate, up)
    if kernels is None or gate.shape != up.shape:
        return module.down_proj(module.act_fn(gate) * up)
    return module.down_proj(_SwiGLU.apply(gate, up, kernels))


def _silu(module: Any) -> bool:
    act = getattr(module, "act_fn", None)
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fuse(model: torch.nn.Module) -> int:
    """Give `model`'s Llama-family RMSNorms and SiLU MLPs the one-pass forms, and its attention
    modules' rotary embedding (their modeling module's function, process-wide); how many norms
    and MLPs took them."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name in ATTENTION_CLASSES:
            # transformers' modeling module, whose rotary function is replaced by name
            modeling: Any = sys.modules[type(module).__module__]
            if callable(getattr(modeling, "apply_rotary_pos_emb", None)):
                modeling.apply_rotary_pos_emb = rotary(modeling.apply_rotary_pos_emb)
        elif name in NORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(rms_norm, module)
            count += 1
        elif name in MLP_CLASSES and _silu(module):
            module.forward = types.MethodType(swiglu_mlp, module)
            count += 1
    return count
