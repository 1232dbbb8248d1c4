"""The actor's attention: transformers' SDPA, with grouped key/value heads kept grouped on CPU,
and the pieces of unpadded micro-batches (`packing="unpad"`) laid out as rows.

transformers hands SDPA grouped-query keys and values as they are (`enable_gqa`) only when no
mask is given; with a mask (a shared prefix's suffixes attend to its cache, which needs one) it
first copies each key/value head once per query head it serves, and the backward sums the
copies. SmolLM2 has 3 key/value heads for 9 query heads: on the actor's shapes torch's CPU
flash kernel runs a layer's forward and backward faster with `enable_gqa` than through the
copies, with the same output and gradients up to the order of a bf16 sum (benchmarks/RESULTS.md).
CUDA's flash kernels take no mask with `enable_gqa`, so the GPU keeps transformers' own path.

Unpadded micro-batches (`Unpadded`): the actor's products (projections, MLP, head) run on the
real tokens of a micro-batch's rows end to end, and only attention, a sixth of an fp32 update,
pays for padding. SDPA has no variable-length form on CPU; a packed row attended through one
block-diagonal mask would attend every token to every piece (transformers' `pack`, several
times slower), and a call per piece costs ~1,000 small calls an update, so the pieces are copied into
padded rows for the one SDPA call and their outputs gathered back. Where a micro-batch's
pieces differ much in length (an agent's one-call and two-call episodes) they go in two
calls instead, each padded to its own bucket's longest (`buckets`): on the main job's piece
lengths that takes one layer's attention less time (benchmarks/bench_buckets.py).

On CPU a bf16 actor's attention (unpadded pieces, a shared prefix's own pass) runs as explicit
products (`_MatmulAttention`): the scores and their gradient in fp32, the products with the
probabilities in bf16, on the bf16 units, with the probabilities kept for the backward. torch's
CPU flash kernel runs bf16 no faster than fp32 (it does not use the bf16 units), and its bf16
backward does its products through a GEMM that allocates on every call from inside its parallel
loop, where a training process keeps one glibc arena (`relayrl.heap.keep_freed_heap`), so the
threads queue for its lock (slower than fp32 on the main job's shapes). The products take a
layer's forward and backward in about half fp32 flash's time, and less again with our kernels
for the fp32 products and the softmax (`kernels/csrc/train_kernels.c`: torch's CPU matmul rounds
a bf16 product's output to bf16); the figures are on benchmarks/RESULTS.md. Where a call's probabilities would exceed `MATMUL_MAX_BYTES`, and for padded
rows (whose padding queries may see no key), attention runs in fp32 through SDPA, which costs a
copy of q, k and v and fp32 saved tensors. Scoring without grad takes the same path as the
update, so that a reference or proximal policy scored apart gives the update's own numbers for
the same weights; the engine has attention of its own.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from relayrl.kernels import train_kernels

GQA_SDPA = "relayrl_sdpa_gqa"
"""The name the attention function is registered under with transformers."""

UNPADDED = "relayrl_unpadded"
"""The decoder keyword that hands `sdpa_gqa` an `Unpadded` layout (transformers passes it on)."""

BUCKET_MIN_SAVING = 0.1
"""`buckets` splits a micro-batch's pieces in two where that saves this share of the padded
attention work; a switch for benchmarks/bench_unpad.py's A/B arm (above 1: never)."""

UPCAST_ON_CPU = True
"""bf16/fp16 attention on CPU runs in fp32 (see the module docstring); a switch for
benchmarks/bench_unpad.py's A/B arm."""

MATMUL_ON_CPU = True
"""bf16 attention on CPU (unpadded pieces, a shared prefix's own pass) runs as bf16 products with
fp32 scores and softmax (`_MatmulAttention`) instead of an fp32 SDPA call, where its
probabilities fit `MATMUL_MAX_BYTES`; a switch for benchmarks/bench_unpad.py."""

MATMUL_MAX_BYTES = 64 << 20
"""The most bytes of bf16 probabilities one `_MatmulAttention` call keeps for its backward (one
layer; the model's layers keep theirs together until the backward). Flash kernels keep none:
longer calls (a long episode's piece of several thousand tokens) go to SDPA in fp32."""


@dataclass(frozen=True)
class Unpadded:
    """Where an unpadded micro-batch's tokens sit when attention lays its pieces out as rows.

    The micro-batch is one row of pieces end to end (`packing="unpad"`): its products run on
    real tokens only, and attention alone pads: each piece becomes a row of `longest` tokens
    (right-padded, so no real query sees a pad) attending to the shared prefix's `prefix` keys,
    to the keys of the stem it continues (if any; `stem` columns, the longest stem's), and
    causally to its own. The padding then costs only the attention's share of the work.
    """

    index_S: torch.Tensor
    """Flat position in the `[rows, longest]` layout of each of the micro-batch's tokens."""
    rows: int
    longest: int
    prefix: int
    mask: torch.Tensor | None
    """`[longest, prefix + longest]`: the prefix, then causal; None without a prefix. With
    stems `[rows, 1, longest, prefix + stem + longest]`: the prefix, the row's stem, causal."""
    stem: int = 0
    """Key columns for stems: the longest stem's length (0: no piece continues a stem)."""
    stem_index: torch.Tensor | None = None
    """`[rows * stem]`: position among the pieces' tokens of each row's stem keys (0 where the
    row's stem is shorter, masked)."""
    take_S: torch.Tensor | None = None
    """Position among the micro-batch's piece tokens of each token this layout lays out, when it
    holds some of the pieces only (one length bucket, `buckets`); None: all, in order."""

    @functools.cached_property
    def bias(self) -> torch.Tensor:
        """The mask as fp32 scores to add: 0 where a query sees a key, -inf elsewhere; `[longest,
        keys]`, or `[rows, 1, longest, keys]` with stems (every query sees itself)."""
        return _bias(self.mask if self.mask is not None else _causal(self.longest,
                                                                      self.index_S.device))

    @functools.cached_property
    def query_tokens(self) -> torch.Tensor:
        """`[rows, longest]`: the token (among the pieces' tokens) at each place of the rows;
        padding takes token 0, which no real query sees, and so gets no gradient from it."""
        tokens = torch.zeros(self.rows * self.longest, dtype=torch.long,
                             device=self.index_S.device)
        taken = (self.take_S if self.take_S is not None
                 else torch.arange(self.index_S.numel(), device=tokens.device))
        return tokens.index_copy_(0, self.index_S, taken).view(self.rows, self.longest)

    @functools.cached_property
    def key_tokens(self) -> torch.Tensor:
        """`[rows, prefix + stem + longest]`: the key (among the prefix's and pieces' tokens)
        at each key column of the rows: the prefix, the row's stem, its own."""
        p, rows = self.prefix, self.rows
        parts = [torch.arange(p, device=self.index_S.device).expand(rows, p)]
        if self.stem:
            assert self.stem_index is not None
            parts.append(p + self.stem_index.view(rows, self.stem))
        return torch.cat([*parts, p + self.query_tokens], 1)

    def gather_index(self, keys: bool, heads: int, length: int,
                     token_major: bool) -> torch.Tensor:
        """`_gather_index` of `key_tokens` (`keys`) or `query_tokens`, kept for the micro-batch's
        other layers."""
        cache = self.__dict__.setdefault("_gathers", {})
        key = (keys, heads, length, token_major)
        if key not in cache:
            tokens_R_C = self.key_tokens if keys else self.query_tokens
            cache[key] = _gather_index(tokens_R_C, heads, length, token_major)
        return cache[key]

    @classmethod
    def of(cls, pieces: Sequence[int], prefix: int, device: torch.device,
           stems: Sequence[int] | None = None, only: Sequence[int] | None = None) -> Unpadded:
        """The layout of pieces this long after a `prefix`-token common prefix; `stems[i]` is
        the index of the piece that piece i continues, or -1; `only`: lay out just these pieces
        (by index), the others' tokens left to another layout."""
        starts = [0, *itertools.accumulate(pieces)]
        take_S = None
        if only is not None:
            take_S = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in only]).to(device)
            stems = [stems[i] for i in only] if stems else None
            pieces = [pieces[i] for i in only]
        longest = max(pieces)
        index_S = torch.cat([torch.arange(n) + i * longest for i, n in enumerate(pieces)])
        stem_len = [starts[s + 1] - starts[s] if s >= 0 else 0 for s in stems] if stems else []
        width = max(stem_len, default=0)
        if not width:
            mask = (torch.ones(longest, prefix + longest, dtype=torch.bool, device=device)
                    .tril(prefix) if prefix else None)
            return cls(index_S.to(device), len(pieces), longest, prefix, mask, take_S=take_S)
        assert stems is not None
        stem_index = torch.tensor([starts[s] + j if j < n else 0 for s, n in zip(stems, stem_len,
                                                                                strict=True)
                                   for j in range(width)], dtype=torch.long)
        rows = len(pieces)
        sees_stem_R_W = torch.arange(width)[None, :] < torch.tensor(stem_len)[:, None]
        mask = torch.cat([torch.ones(rows, longest, prefix, dtype=torch.bool),
                          sees_stem_R_W[:, None, :].expand(rows, longest, width),
                          torch.ones(longest, longest, dtype=torch.bool).tril()
                          .expand(rows, longest, longest)], 2)[:, None]
        return cls(index_S.to(device), rows, longest, prefix, mask.to(device), width,
                   stem_index.to(device), take_S)


def buckets(pieces: Sequence[int], prefix: int, device: torch.device,
            stems: Sequence[int] | None = None, min_saving: float | None = None
            ) -> Unpadded | tuple[Unpadded, Unpadded]:
    """The pieces as one layout, or as two by length (the short pieces padded only to the
    shorter bucket's longest) where that saves at least `min_saving` (default
    `BUCKET_MIN_SAVING`) of the padded work."""
    min_saving = BUCKET_MIN_SAVING if min_saving is None else min_saving
    stem_len = [pieces[s] if s >= 0 else 0 for s in stems] if stems else [0] * len(pieces)
    order = sorted(range(len(pieces)), key=lambda i: pieces[i])

    def work(part: Sequence[int]) -> int:
        longest = max(pieces[i] for i in part)
        return len(part) * longest * (prefix + max(stem_len[i] for i in part) + longest)
    if len(pieces) < 2:
        return Unpadded.of(pieces, prefix, device, stems)
    cost, cut = min((work(order[:c]) + work(order[c:]), c) for c in range(1, len(order)))
    if cost > (1 - min_saving) * work(order):
        return Unpadded.of(pieces, prefix, device, stems)
    return (Unpadded.of(pieces, prefix, device, stems, sorted(order[:cut])),
            Unpadded.of(pieces, prefix, device, stems, sorted(order[cut:])))


def _token_rows(x_1_H_N_D: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """`[1, H, N, D]` as a `[N * H, D]` or `[H * N, D]` matrix of its memory (a view where it
    can be), and whether it is token-major (projections' outputs viewed as heads are)."""
    x_H_N_D = x_1_H_N_D[0]
    token_major = x_H_N_D.stride(1) > x_H_N_D.stride(0)
    flat = x_H_N_D.transpose(0, 1) if token_major else x_H_N_D
    return flat.reshape(-1, x_H_N_D.shape[-1]), token_major


def _gather_index(tokens_R_C: torch.Tensor, heads: int, length: int,
                  token_major: bool) -> torch.Tensor:
    """Rows of a `_token_rows` matrix that lay out `[R, heads, C, D]` from the tokens
    `tokens_R_C` (each row's tokens, in order) of a tensor `length` tokens long."""
    rows, width = tokens_R_C.shape
    head_1_H_1 = torch.arange(heads, device=tokens_R_C.device).view(1, heads, 1)
    tok_R_1_C = tokens_R_C.view(rows, 1, width)
    index = tok_R_1_C * heads + head_1_H_1 if token_major else head_1_H_1 * length + tok_R_1_C
    return index.reshape(-1)


def _laid_out(x_1_H_N_D: torch.Tensor, layout: Unpadded, keys: bool) -> torch.Tensor:
    """The layout's rows of queries `x` (`query_tokens`) or of keys or values (`keys`:
    `key_tokens`) as `[rows, H, C, D]`: one gather, whose backward is one scatter.

    A key is taken by many rows (a prefix key by every row), and its gradients must be summed
    before rounding. torch's CPU scatter does (it sums in fp32); CUDA's adds each one atomically
    in the tensor's dtype, so reduced-precision keys and values off the CPU go through
    `_WideGather`.
    """
    _, heads, length, dim = x_1_H_N_D.shape
    flat, token_major = _token_rows(x_1_H_N_D)
    index = layout.gather_index(keys, heads, length, token_major)
    if keys and flat.device.type != "cpu" and flat.dtype in (torch.bfloat16, torch.float16):
        rows = _WideGather.apply(flat, index)
    else:
        rows = flat.index_select(0, index)
    return rows.view(layout.rows, heads, -1, dim)


class _WideGather(torch.autograd.Function):
    """`flat.index_select(0, index)` whose backward sums each row's gradients in fp32 and
    rounds once."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The rows `index` of `flat`."""
        ctx.save_for_backward(index)
        ctx.source = (flat.shape, flat.dtype)
        return flat.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The gradient of `flat` (none for the index)."""
        (index,) = ctx.saved_tensors
        shape, dtype = ctx.source
        total = torch.zeros(shape, dtype=torch.float32, device=grad.device)
        return total.index_add_(0, index, grad.float()).to(dtype), None


def _output_rows(parts: tuple[Unpadded, ...], heads: int) -> torch.Tensor:
    """`[S * heads]`: for each token of the pieces and head, in that order, its row among the
    parts' attention outputs `[rows, heads, longest, D]` put end to end (kept per micro-batch)."""
    cache = parts[0].__dict__.setdefault("_outputs", {})
    key = (tuple(id(part) for part in parts), heads)
    if key in cache:
        return cache[key]
    tokens = sum(part.index_S.numel() for part in parts)
    index_S_H = torch.empty(tokens, heads, dtype=torch.long, device=parts[0].index_S.device)
    offset = 0
    for part in parts:
        row, place = part.index_S // part.longest, part.index_S % part.longest
        rows_S_H = (offset + (row * heads)[:, None] * part.longest
                    + torch.arange(heads, device=row.device)[None] * part.longest + place[:, None])
        taken = (part.take_S if part.take_S is not None
                 else torch.arange(part.index_S.numel(), device=row.device))
        index_S_H[taken] = rows_S_H
        offset += part.rows * heads * part.longest
    cache[key] = index_S_H.view(-1)
    return cache[key]


def unpadded_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       layout: Unpadded | tuple[Unpadded, ...], scaling: float | None
                       ) -> torch.Tensor:
    """Attention of an unpadded micro-batch's queries `[1, Hq, S, D]` over its keys and
    values `[1, Hk, prefix + S, D]`, as `[1, S, Hq, D]`; one attention call per layout (bucket).

    Each layout's rows of q, k and v are one gather each (`Unpadded.query_tokens`,
    `key_tokens`), and the outputs of all layouts go back to token order in one more
    (`_output_rows`): on the main job's shapes one layer's attention, forward and backward,
    took 1.10-1.19x less time than with a zero fill, a copy and a concatenation per tensor and
    layout (the update 1.02-1.05x; benchmarks/RESULTS.md).
    """
    dtype = query.dtype
    if _upcast(query) and not MATMUL_ON_CPU:  # once for every bucket
        query, key, value = query.float(), key.float(), value.float()
    parts = layout if isinstance(layout, tuple) else (layout,)
    outs = []
    for part in parts:
        q = _laid_out(query, part, keys=False)
        k, v = _laid_out(key, part, keys=True), _laid_out(value, part, keys=True)
        if _matmul(q, k.shape[2]):
            out = _MatmulAttention.apply(q, k, v, part.bias, scaling or q.shape[-1] ** -0.5)
        else:
            if _upcast(q):
                q, k, v = q.float(), k.float(), v.float()
            grouped = _grouped(q, k)
            if grouped and not _masks_grouped_heads(q.device):
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
                grouped = False
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=part.mask, scale=scaling,
                                                 is_causal=part.mask is None,
                                                 enable_gqa=grouped).contiguous()
        outs.append(out.view(-1, out.shape[-1]))
    heads, dim = query.shape[1], query.shape[3]
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    index = _output_rows(parts, heads)
    return flat.index_select(0, index).view(1, -1, heads, dim).to(dtype)


def sdpa_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
             scaling: float | None = None, is_causal: bool | None = None,
             **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: SDPA with `enable_gqa`, mask or not; an
    unpadded micro-batch's pieces as rows (`UNPADDED`); off the CPU, transformers' own SDPA."""
    layout = kwargs.pop(UNPADDED, None)
    if layout is not None:
        if dropout:
            raise ValueError("unpadded attention runs without dropout (the actor scores in eval mode)")
        return unpadded_attention(query, key, value, layout, scaling), None
    if (query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_length:  # as transformers does: a prefill into an empty static cache
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    if is_causal and not dropout and _matmul(query, q_length):  # a shared prefix's own pass
        out = _MatmulAttention.apply(query, key, value, _bias(_causal(q_length, query.device)),
                                     scaling or query.shape[-1] ** -0.5)
        return out.transpose(1, 2).contiguous(), None
    dtype = query.dtype
    if _upcast(query):
        query, key, value = query.float(), key.float(), value.float()
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                         enable_gqa=_grouped(query, key))
    return out.transpose(1, 2).contiguous().to(dtype), None


def _upcast(query: torch.Tensor) -> bool:
    """Whether this attention runs in fp32: reduced precision, on CPU."""
    return (UPCAST_ON_CPU and query.device.type == "cpu"
            and query.dtype in (torch.bfloat16, torch.float16))


def _matmul(query: torch.Tensor, keys: int) -> bool:
    """Whether attention of `query` `[rows, heads, queries, D]` over `keys` keys runs as
    `_MatmulAttention`: bf16, on CPU, its probabilities within `MATMUL_MAX_BYTES`."""
    rows, heads, queries, _ = query.shape
    return (MATMUL_ON_CPU and query.device.type == "cpu" and query.dtype == torch.bfloat16
            and 2 * rows * heads * queries * keys <= MATMUL_MAX_BYTES)


def _causal(length: int, device: torch.device) -> torch.Tensor:
    """`[length, length]`: query i sees keys 0..i."""
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def _bias(sees: torch.Tensor) -> torch.Tensor:
    """A boolean mask as fp32 scores to add: 0 where a query sees a key, -inf elsewhere."""
    return torch.zeros(sees.shape, device=sees.device).masked_fill_(~sees, float("-inf"))


def _fp32_product(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`scale * a @ b^T` in fp32 from bf16 operands: our kernel where it is built
    (kernels/csrc/train_kernels.c, at the bf16 units' rate), else an fp32 product of upcast copies."""
    kernel = train_kernels()
    if kernel is not None and kernel.supports(a, b):
        return kernel.product(a, b, scale)
    return torch.matmul(a.float() * scale, b.float().transpose(-1, -2))


def _softmax(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bf16 `softmax(scores + bias, -1)` of fp32 scores `[rows, heads, L, K]` (overwritten) and a
    bias `[L, K]` or `[rows, 1, L, K]`: our one-pass kernel where it is built, else torch's."""
    kernel = train_kernels()
    if kernel is not None:
        return kernel.softmax(scores, bias.contiguous())
    return torch.softmax(scores.add_(bias), -1).to(torch.bfloat16)


def _softmax_grad(d_p: torch.Tensor, p: torch.Tensor, d_out: torch.Tensor,
                  out: torch.Tensor) -> torch.Tensor:
    """dS = P * (dP - rowsum(dO * O)) in bf16 from fp32 `d_p`, in fp32 until rounded for the
    products with q and k: our one-pass kernel where it is built, else torch's ops."""
    kernel = train_kernels()
    if kernel is not None and out.shape[-1] % 16 == 0:
        return kernel.softmax_grad(d_p, p, d_out, out)
    delta = (d_out.float() * out.float()).sum(-1, keepdim=True)
    return d_p.sub_(delta).mul_(p).to(torch.bfloat16)


class _MatmulAttention(torch.autograd.Function):
    """Attention of `q` `[rows, Hq, L, D]` over `k`, `v` `[rows, Hk, keys, D]` (bf16) with the
    additive fp32 `bias` (`Unpadded.bias`), as explicit products: the scores `q k^T` and `dP =
    dO v^T` in fp32 (rounded to bf16, the scores cost 2-3x the output's error where they are
    large), the products with the probabilities `P` and with `dS` in bf16, as GPU flash kernels
    do them. The query heads of one key/value head are stacked along the queries, so grouped
    heads need no copies. Where our kernels are built (kernels/csrc/train_kernels.c) the fp32
    products run on the bf16 units and the softmax and its backward take one pass a row, well
    ahead of torch's CPU flash kernel in fp32, whose products do not use the bf16 units
    (benchmarks/RESULTS.md)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                bias: torch.Tensor, scale: float) -> torch.Tensor:
        """The output `[rows, Hq, L, D]` in `q`'s dtype."""
        rows, hq, length, d = q.shape
        hk = k.shape[1]
        q_R_Hk_GL_D = q.reshape(rows, hk, hq // hk * length, d)
        scores = _fp32_product(q_R_Hk_GL_D, k, scale)
        p = _softmax(scores.view(rows, hq, length, -1), bias).view(scores.shape)
        out = torch.matmul(p, v)
        ctx.save_for_backward(q_R_Hk_GL_D, k, v, p, out)
        ctx.scale = scale
        return out.view(rows, hq, length, d)

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Gradients of q, k and v (none for the bias and scale)."""
        q, k, v, p, out = ctx.saved_tensors
        d_out_g = d_out.reshape(q.shape).contiguous()
        d_v = torch.matmul(p.transpose(-1, -2), d_out_g)
        d_scores = _softmax_grad(_fp32_product(d_out_g, v), p, d_out_g, out)
        d_q = torch.matmul(d_scores, k).mul_(ctx.scale)
        d_k = torch.matmul(d_scores.transpose(-1, -2), q).mul_(ctx.scale)
        return d_q.view(d_out.shape), d_k, d_v, None, None


def _masks_grouped_heads(device: torch.device) -> bool:
    """Whether SDPA on `device` takes a mask with grouped heads (CUDA's kernels do not)."""
    return device.type == "cpu"


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


def resolve(attn_implementation: str) -> str:
    """The implementation to load: "sdpa" becomes `GQA_SDPA` (which hands non-CPU tensors to
    transformers' own SDPA, unpadded micro-batches aside); anything else is kept."""
    if attn_implementation == "sdpa":
        register()
        return GQA_SDPA
    return attn_implementation
