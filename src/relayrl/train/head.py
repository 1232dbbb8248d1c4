"""Token logprobs through the output head, chunked and fused: `head_logprobs`.

An update scores ~1,200 trained tokens against a 49,152-token vocabulary: fp32 logits of 240 MB.
Autograd's `gather - logsumexp` over them makes several tensors that size, and torch's CPU
`logsumexp` alone is several times slower than the in-place passes here (max, subtract, exp,
sum, divide, a slice of rows at a time so that each pass over a slice hits cache). The backward
turns the kept probabilities into the logits' gradient in place and runs the two matrix products
in the hidden state's dtype (bf16 under bf16 compute, as the decoder's own backward; the
forward's logits stay fp32). What it saves an update: benchmarks/RESULTS.md.

Tradeoff: the probabilities are kept for the backward (the same memory autograd kept for the
logits) instead of being recomputed, which would cost a third head product; the backward
overwrites them, so a graph through this runs backward once (a second time raises autograd's
in-place error rather than using them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from relayrl.kernels import train_kernels

CHUNK_BYTES = 8 << 20
"""Bytes of fp32 logits processed per slice of rows: small enough to stay in the last-level cache."""


def _logits(hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor) -> torch.Tensor:
    """fp32 logits `[N, V]`: one matrix product (slicing it by rows halved its speed)."""
    if weight_V_H.dtype == torch.float32:
        kernel = train_kernels()
        if kernel is not None and kernel.supports(hidden_N_H, weight_V_H):
            # bf16 hidden states, an fp32 head: the weight as two bf16 terms on the bf16 units
            # (kernels/csrc/train_kernels.c), logits within ~1e-5 of the fp32 product at 2.2x its speed
            return kernel.product(hidden_N_H, weight_V_H)
        return hidden_N_H.float() @ weight_V_H.t()
    # a bf16 head: its logits are rounded as the head's dtype rounds them, then widened
    return (hidden_N_H.to(weight_V_H.dtype) @ weight_V_H.t()).float()


def _log_softmax_at_(logits_N_V: torch.Tensor, targets_N: torch.Tensor,
                     keep_probs: bool) -> torch.Tensor:
    """log_softmax(logits)[n, targets[n]], turning `logits_N_V` into probabilities in place
    (`keep_probs`) or into scratch; a slice of rows at a time, so the passes hit cache."""
    n, vocab = logits_N_V.shape
    out_N = torch.empty(n, dtype=torch.float32, device=logits_N_V.device)
    step = max(1, CHUNK_BYTES // (4 * vocab))
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        logits_C_V = logits_N_V[rows]
        target_C = logits_C_V.gather(-1, targets_N[rows, None])[:, 0]
        max_C_1 = logits_C_V.amax(-1, keepdim=True)
        exp_C_V = logits_C_V.sub_(max_C_1).exp_()
        sum_C_1 = exp_C_V.sum(-1, keepdim=True)
        if keep_probs:
            exp_C_V.div_(sum_C_1)
        out_N[rows] = target_C - (max_C_1[:, 0] + sum_C_1[:, 0].log())
    return out_N


class _HeadLogprobs(torch.autograd.Function):
    """logprob[n] = log_softmax(hidden[n] @ weight.T)[targets[n]], probabilities kept in place."""

    @staticmethod
    def forward(ctx: Any, hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor,
                targets_N: torch.Tensor, low_V_H: torch.Tensor | None) -> torch.Tensor:
        probs_N_V = _logits(hidden_N_H, weight_V_H)
        out_N = _log_softmax_at_(probs_N_V, targets_N, keep_probs=True)
        ctx.save_for_backward(hidden_N_H, weight_V_H, targets_N, probs_N_V, low_V_H)
        return out_N

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden_N_H, weight_V_H, targets_N, probs_N_V, low_V_H = ctx.saved_tensors
        # The products run in the decoder's dtype, as the rest of its backward does: in bf16
        # they take 0.35 s against 0.87 s in fp32 (one thread, 1,238 x 49,152).
        dtype = hidden_N_H.dtype
        grad_logits_N_V = _logits_grad(probs_N_V, targets_N, grad_N, dtype)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            low = low_V_H if low_V_H is not None else weight_V_H.to(dtype)
            grad_hidden = grad_logits_N_V @ low
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_logits_N_V.t() @ hidden_N_H).to(weight_V_H.dtype)
        return grad_hidden, grad_weight, None, None


def _logits_grad(probs_N_V: torch.Tensor, targets_N: torch.Tensor, grad_N: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """d logprob / d logits = onehot(target) - softmax, times `grad_N`, in `dtype`: built in the
    saved buffer, and cast a slice of rows at a time (one pass, not two, over fp32 [N, V])."""
    n, vocab = probs_N_V.shape
    out_N_V = probs_N_V if dtype == probs_N_V.dtype else torch.empty(
        n, vocab, dtype=dtype, device=probs_N_V.device)
    step = max(1, CHUNK_BYTES // (4 * vocab))
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        chunk_C_V = probs_N_V[rows].mul_(-grad_N[rows, None])
        index_C = torch.arange(chunk_C_V.shape[0], device=chunk_C_V.device)
        chunk_C_V[index_C, targets_N[rows]] += grad_N[rows]
        if out_N_V is not probs_N_V:
            out_N_V[rows] = chunk_C_V
    return out_N_V


def head_logprobs(hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor,
                  targets_N: torch.Tensor, low_V_H: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logprobs `[N]` of `targets_N` under the head `weight_V_H` (no bias) on `hidden_N_H`.

    `low_V_H`, where the caller holds one, is `weight_V_H` already cast to the hidden states'
    dtype (the bf16 copy's tied head), which the backward then uses instead of casting again.
    """
    if hidden_N_H.shape[0] == 0:
        return hidden_N_H.new_zeros(0, dtype=torch.float32)
    if low_V_H is not None and (low_V_H.dtype != hidden_N_H.dtype
                                or low_V_H.shape != weight_V_H.shape):
        raise ValueError(f"low_V_H must be weight_V_H in {hidden_N_H.dtype}")
    if torch.is_grad_enabled() and (hidden_N_H.requires_grad or weight_V_H.requires_grad):
        return _HeadLogprobs.apply(hidden_N_H, weight_V_H, targets_N,
                                   None if low_V_H is None else low_V_H.detach())
    return _log_softmax_at_(_logits(hidden_N_H, weight_V_H), targets_N, keep_probs=False)
