"""Sampling math for `LocalEngine`: one batched step from next-token logits to tokens + logprobs.

What a logprob means here: the log-probability of the sampled token under the temperature-scaled
distribution `log_softmax(logits / T)` (T = 1 for greedy), computed in fp32 from the logits,
BEFORE top-p/top-k truncation. That is the number a trainer can recompute from the same weights
without knowing the truncation, and what `GenerateOutput.logprobs` promises.

Every sampled row draws exactly one uniform number per token (inverse-CDF sampling), from its own
`torch.Generator` when the request has a seed: a seeded request then sees the same random stream
whatever else shares the batch. Tradeoff: top-p needs tokens in probability order, and sorting the
whole vocabulary per row is slow on CPU, so the nucleus is first looked for among the top
`NUCLEUS_PROBES[0]` tokens, and only rows whose nucleus is larger look further (a full sort last).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NUCLEUS_PROBES = (64, 1024)
"""Top-k sizes tried, in order, before a full sort of the vocabulary for top-p."""


@dataclass(frozen=True)
class RowParams:
    """How to sample one row of the batch."""

    temperature: float
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 turns top-k off."""
    top_logprobs: int = 0
    generator: torch.Generator | None = None
    """The request's own random stream (seeded requests); None draws from the shared one."""

    @property
    def truncates(self) -> bool:
        """Whether top-p or top-k removes any token."""
        return self.top_p < 1.0 or self.top_k > 0


@dataclass(frozen=True)
class Sampled:
    """One token per row, aligned with the rows given to `sample`."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    """Per row, the `top_logprobs` most likely (token id, logprob) pairs; empty when not asked."""


def sample(logits_B_V: torch.Tensor, rows: Sequence[RowParams], shared: torch.Generator) -> Sampled:
    """Pick the next token of every row; logprobs follow the module docstring's definition."""
    logits_B_V = logits_B_V.float()
    temps = [r.temperature if r.temperature > 0 else 1.0 for r in rows]
    if any(t != 1.0 for t in temps):
        logits_B_V = logits_B_V / torch.tensor(temps, device=logits_B_V.device)[:, None]
    # On CPU log_softmax is cheaper than logsumexp, and max(dim) than argmax (measured).
    logprobs_B_V = torch.log_softmax(logits_B_V, dim=-1)

    greedy = [i for i, r in enumerate(rows) if r.temperature == 0]
    drawn = [i for i, r in enumerate(rows) if r.temperature > 0]
    tokens_B = torch.empty(len(rows), dtype=torch.long, device=logits_B_V.device)
    if greedy:
        g = _index(greedy, logits_B_V)
        tokens_B[g] = logprobs_B_V[g].max(dim=-1).indices
    if drawn:
        d = _index(drawn, logits_B_V)
        picked = [rows[i] for i in drawn]
        u_D = _uniforms(picked, shared).to(logits_B_V.device)
        tokens_B[d] = _draw(logprobs_B_V[d].exp(), u_D, picked)

    chosen_B = logprobs_B_V.gather(1, tokens_B[:, None])[:, 0]
    return Sampled(
        token_ids=tokens_B.tolist(),
        logprobs=chosen_B.tolist(),
        top_logprobs=_top_logprobs(logprobs_B_V, [r.top_logprobs for r in rows]),
    )


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor | slice:
    # A slice keeps the common all-rows case free of gather/scatter copies.
    if rows == list(range(like.shape[0])):
        return slice(None)
    return torch.tensor(rows, device=like.device)


def _uniforms(rows: Sequence[RowParams], shared: torch.Generator) -> torch.Tensor:
    """One U[0, 1) per row: seeded rows from their own generator, the others from `shared`."""
    u = torch.rand(len(rows), generator=shared)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand((), generator=r.generator)
    return u


def _draw(probs_D_V: torch.Tensor, u_D: torch.Tensor, rows: Sequence[RowParams]) -> torch.Tensor:
    """Inverse-CDF sampling, each row within its own top-k/top-p set."""
    out_D = torch.empty(len(rows), dtype=torch.long, device=probs_D_V.device)
    cut = [i for i, r in enumerate(rows) if r.truncates]
    full = [i for i, r in enumerate(rows) if not r.truncates]
    if full:
        f = _index(full, probs_D_V)
        # Any fixed token order is a valid CDF order; vocabulary order needs no sort.
        out_D[f] = _invert_cdf(probs_D_V[f].cumsum(dim=-1), u_D[f])
    if cut:
        c = _index(cut, probs_D_V)
        out_D[c] = _draw_truncated(probs_D_V[c], u_D[c], [rows[i] for i in cut], NUCLEUS_PROBES)
    return out_D


def _draw_truncated(
    probs_R_V: torch.Tensor, u_R: torch.Tensor, rows: Sequence[RowParams], probes: tuple[int, ...]
) -> torch.Tensor:
    vocab = probs_R_V.shape[-1]
    k = min(vocab, max(probes[0] if probes else vocab, *(r.top_k for r in rows)))
    if k < vocab:
        vals_R_K, ids_R_K = probs_R_V.topk(k, dim=-1)  # sorted, most likely first
    else:
        vals_R_K, ids_R_K = probs_R_V.sort(dim=-1, descending=True)  # faster than a full topk
    top_k_R = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=u_R.device)
    top_p_R = torch.tensor([r.top_p for r in rows], device=u_R.device)
    cum_R_K = vals_R_K.cumsum(dim=-1)
    rank_K = torch.arange(k, device=u_R.device)
    # Nucleus: keep a token while the mass before it is below top_p (the first always stays).
    keep_R_K = (rank_K[None, :] < top_k_R[:, None]) & ((cum_R_K - vals_R_K) < top_p_R[:, None])
    out_R = _invert_cdf((vals_R_K * keep_R_K).cumsum(dim=-1), u_R, ids_R_K)
    complete_R = (top_k_R <= k) | (cum_R_K[:, -1] >= top_p_R)
    if k < vocab and not bool(complete_R.all()):
        # The nucleus reaches past this probe for some rows: look further for those only.
        redo = torch.nonzero(~complete_R)[:, 0]
        again = [rows[i] for i in redo.tolist()]
        out_R[redo] = _draw_truncated(probs_R_V[redo], u_R[redo], again, probes[1:])
    return out_R


def _invert_cdf(
    cdf_R_N: torch.Tensor, u_R: torch.Tensor, ids_R_N: torch.Tensor | None = None
) -> torch.Tensor:
    """The first position whose cumulative mass exceeds u × total (ids_R_N maps positions to ids)."""
    total_R = cdf_R_N[:, -1]
    # Strictly below the total, so the chosen position always carries probability mass.
    target_R = torch.minimum(u_R * total_R, torch.nextafter(total_R, torch.zeros_like(total_R)))
    pos_R = torch.searchsorted(cdf_R_N, target_R[:, None], right=True)
    pos_R = pos_R.clamp_(max=cdf_R_N.shape[-1] - 1)
    return pos_R[:, 0] if ids_R_N is None else ids_R_N.gather(1, pos_R)[:, 0]


def _top_logprobs(logprobs_B_V: torch.Tensor, wanted: list[int]) -> list[list[tuple[int, float]]]:
    most = min(max(wanted, default=0), logprobs_B_V.shape[-1])
    if most <= 0:
        return [[] for _ in wanted]
    vals_B_N, ids_B_N = logprobs_B_V.topk(most, dim=-1)
    vals, ids = vals_B_N.tolist(), ids_B_N.tolist()
    return [list(zip(ids[i][:n], vals[i][:n], strict=True)) for i, n in enumerate(wanted)]
