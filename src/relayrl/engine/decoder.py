"""Lean decode steps and prefill for Llama-family models (Llama, Qwen2, Mistral), on slot KV rows.

Why not the model's own forward: at decode batch sizes transformers' Llama forward is mostly
overhead, not arithmetic. One step of SmolLM2-135M (30 layers) runs ~50 small ops per layer
(RMSNorm as 6 ops with 2 casts, rotary as 10, three separate q/k/v products, two for the MLP, mask
and position plumbing, a module call per op) and a Python frame for each; at batch 1 that was
most of the step. This step reads the same weights and the same cache but:

- fuses q/k/v into one product and gate/up into another (prepacked for oneDNN in bf16, like
  `_pack_linears`), so a layer makes 4 matrix products, not 7;
- applies rotary to q and k together with a precomputed cos/sin table (4 ops, the same
  arithmetic as transformers' `apply_rotary_pos_emb`, so the same bits);
- writes each layer's new key/value straight into the cache rows and attends with one call per
  layer over the key/value heads (GQA packed as transformers does for one query token): the
  compiled CPU kernel of `relayrl.kernels` where it is built, else `scaled_dot_product_attention`,
  with no mask when every row sees every column;
- keeps transformers' numerics where they matter (RMSNorm in fp32, residuals in the model dtype),
  so logprobs still match a fresh forward pass.

Where the compiled whole-step kernel builds (`relayrl.kernels.decode_step_kernel`: a C compiler and
AVX512-BF16) and the model is bf16 without biases, `step` is one call into it instead: the same
operations in the same order with the same bf16 roundings, its products on weights kept in the
kernel's packed layout (`DecodeStep.pack`, remade with the fused copies). Its sums run in another
order, so its logits are not bit-equal to the op-by-op step's; they are as close to an fp32 step
(tested). One row: 28 -> 14 ms a step, 8 rows: 37 -> 20 ms (benchmarks/RESULTS.md). An fp32
model (what `dtype="auto"` loads on CPUs without bf16 units) takes the fp32 kernel for AVX2 + FMA
(`decode_step_kernel(torch.float32)`) the same way; its logits differ from the op-by-op fp32
step's only by the order of fp32 sums.

`prefill` runs prompts through the same products: their new tokens one after another with no
padding (a batch of prompts of unequal length wastes no product work), attention padded per row
with one additive mask (it reads the columns a reused prefix already filled), and the head only on
each prompt's last token. Its order of sums differs from the model's padded forward, so in bf16 its
logprobs differ by rounding; in fp32 they match to 1e-5.

The fused copies are remade when any source weight changes in place (its version counter moves:
`update_weights`, an optimizer step on a shared model), checked once per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from relayrl.kernels.cpu import DecodeAttention, DecodeStep, StepLayer

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
"""Architectures whose decoder layer is exactly: RMSNorm, rotary GQA attention, RMSNorm, SwiGLU."""
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""Rotary variants whose frequencies do not depend on the sequence length."""
_PACK_HINT = 32


@dataclass
class _Product:
    """One (possibly fused) linear layer: x @ W.T + b, from the model's weights."""

    sources: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    packed: bool
    weight: Any = None
    bias: torch.Tensor | None = None
    for_kernel: DecodeStep | None = None
    """Also keep the weight in this kernel's layout (`kernel_weight`)."""
    kernel_weight: torch.Tensor | None = None

    def rebuild(self) -> None:
        """Make the fused (and prepacked) weight from the current source weights."""
        weight = torch.cat(self.sources) if len(self.sources) > 1 else self.sources[0]
        weight = weight.detach()
        if any(b is not None for b in self.biases):
            parts = [
                b.detach() if b is not None else s.new_zeros(s.shape[0])
                for s, b in zip(self.sources, self.biases, strict=True)
            ]
            self.bias = torch.cat(parts)
        else:
            self.bias = None
        if self.for_kernel is not None:
            self.kernel_weight = self.for_kernel.pack(weight)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        self.weight = weight

    def kernel_tensor(self) -> torch.Tensor:
        """The weight in the kernel's layout, which `rebuild` made (the product has `for_kernel`)."""
        if self.kernel_weight is None:
            raise RuntimeError("this product keeps no weight for a step kernel")
        return self.kernel_weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: _Product
    o: _Product
    gate_up: _Product
    down: _Product


class LeanDecoder:
    """One decode step (one new token per row) for a supported model; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        packed: bool,
        attention: DecodeAttention | None = None,
        step_kernel: DecodeStep | None = None,
        products_from: int | None = None,
    ) -> None:
        # transformers' config and decoder stack: their attributes depend on the architecture
        # (checked in `build`), which nn.Module's __getattr__ types as Tensor | Module
        config: Any = model.config
        inner: Any = model.model
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        attn0 = inner.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.scaling = float(attn0.scaling)
        self.intermediate = int(config.intermediate_size)
        self.eps = float(inner.norm.variance_epsilon)
        self.dtype: torch.dtype = inner.embed_tokens.weight.dtype
        self.embed: torch.Tensor = inner.embed_tokens.weight
        self.final_norm: torch.Tensor = inner.norm.weight
        head: Any = model.lm_head
        self.lm_head = _Product([head.weight], [head.bias], packed)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    norm_in=layer.input_layernorm.weight,
                    norm_post=layer.post_attention_layernorm.weight,
                    qkv=_Product(
                        [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
                        [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias],
                        packed,
                    ),
                    o=_Product([a.o_proj.weight], [a.o_proj.bias], packed),
                    gate_up=_Product(
                        [m.gate_proj.weight, m.up_proj.weight],
                        [m.gate_proj.bias, m.up_proj.bias],
                        packed,
                    ),
                    down=_Product([m.down_proj.weight], [m.down_proj.bias], packed),
                )
            )
        self._products = [self.lm_head] + [
            p for x in self.layers for p in (x.qkv, x.o, x.gate_up, x.down)
        ]
        self._sources = [
            t for p in self._products for t in (*p.sources, *p.biases) if t is not None
        ]
        self._seen: Any = None
        self._cos, self._sin = _rope_tables(model, self.dtype)
        groups = self.heads // self.kv_heads
        supported = attention is not None and attention.supports(self.dtype, groups, self.head_dim)
        self.attention = attention if supported else None
        """The CPU decode-attention kernel `step` uses, or None: torch's SDPA."""
        hidden = int(self.embed.shape[1])
        # The kernel attends to each row's columns 0..cols[b], the only mask `step` is given.
        fits = (
            step_kernel is not None
            and self.dtype == step_kernel.dtype
            and self.embed.device.type == "cpu"
            and all(b is None for p in self._products for b in p.biases)
            and step_kernel.supports(hidden, self.heads, self.kv_heads, self.head_dim,
                                     self.intermediate, int(self.embed.shape[0]))
        )
        self.step_kernel = step_kernel if fits else None
        """The compiled whole-step kernel `step` runs (the model's dtype, no biases), or None:
        op by op."""
        self._table: Any = None
        if self.step_kernel is not None:
            for product in self._products:
                product.for_kernel = self.step_kernel
        pieces = self.step_kernel.pieces if self.step_kernel is not None else None
        self.products_from = products_from if pieces is not None else None
        """Batches of at least this many rows run the step kernel's pieces around oneDNN's
        products (`_step_pieces`); smaller ones the whole step kernel. None: always the kernel."""

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        packed: bool,
        attention: DecodeAttention | None = None,
        step_kernel: DecodeStep | None = None,
        products_from: int | None = None,
    ) -> LeanDecoder | None:
        """The lean step for `model`, or None when its architecture is not one it reproduces."""
        config = model.config
        if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            return None
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
            return None
        if getattr(config, "hidden_act", None) != "silu":
            return None
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
            return None
        try:
            return cls(model, packed, attention, step_kernel, products_from)
        except AttributeError:  # a layout we do not know: keep the model's own forward
            return None

    def _refresh(self) -> None:
        # In-place changes bump version counters; their sum only ever grows. The kernel's table
        # holds the norms' addresses, so a norm whose storage was swapped (`.data = ...`) counts.
        seen: Any = sum(t._version for t in self._sources)
        if self.step_kernel is not None:
            seen = (seen, *(t.data_ptr() for x in self.layers for t in (x.norm_in, x.norm_post)))
        if seen != self._seen:
            for product in self._products:
                product.rebuild()
            if self.step_kernel is not None:
                self._table = self.step_kernel.layers([
                    StepLayer(x.norm_in.detach(), x.norm_post.detach(), *(
                        p.kernel_tensor() for p in (x.qkv, x.o, x.gate_up, x.down)))
                    for x in self.layers
                ])
            self._seen = seen

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(self.dtype)

    def step(
        self,
        ids_B: torch.Tensor,
        cols_B: torch.Tensor,
        caches: list[torch.Tensor],
        visible: int,
        mask_B_V: torch.Tensor | None,
        cols: list[int],
    ) -> torch.Tensor:
        """Logits [B, vocab] of the next token; row b's new key/value go to column cols[b].

        `caches[i]` is layer i's cache [rows, 2 * kv_heads, columns, head_dim], keys in the
        first kv_heads, values in the rest; row b of the batch is cache row b. `cols_B` is
        `cols` as a tensor. `mask_B_V` says which of the first `visible` columns each row
        attends to (None: all of them); it must be a prefix, columns 0..cols[b], which is what
        the decode-attention kernel reads from `cols_B` alone.
        """
        self._refresh()
        if self.products_from is not None and ids_B.shape[0] >= self.products_from:
            return self._step_pieces(ids_B, cols_B, caches)
        if self.step_kernel is not None:
            return self.step_kernel(
                self._table, caches, ids_B, cols_B, self.embed, self.final_norm,
                self.lm_head.kernel_tensor(), self._cos, self._sin, self.heads, self.kv_heads,
                self.intermediate, self.eps, self.scaling, torch.get_num_threads())
        batch = ids_B.shape[0]
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        qk = heads + kv
        cos = self._cos[cols_B][:, None, :]
        sin = self._sin[cols_B][:, None, :]
        rows_B = torch.arange(batch, device=ids_B.device)
        mask = None
        attention = self.attention
        lengths_B = cols_B + 1 if attention is not None else None
        if mask_B_V is not None and lengths_B is None:
            # Additive, made once: SDPA would turn a boolean mask into this in every layer.
            mask = torch.zeros(mask_B_V.shape, dtype=self.dtype, device=mask_B_V.device)
            mask = mask.masked_fill_(~mask_B_V, float("-inf"))[:, None, None, :]
        x = F.embedding(ids_B, self.embed)
        for layer, cache in zip(self.layers, caches, strict=True):
            qkv = layer.qkv(self._rms_norm(x, layer.norm_in)).view(batch, qk + kv, dim)
            both = qkv[:, :qk]
            # Rotated keys go back next to the values: one cache write for both.
            qkv[:, :qk] = both * cos + both.roll(dim // 2, -1) * sin
            if batch == 1:
                cache[0, :, cols[0]] = qkv[0, heads:]  # plain slicing: cheaper than index_put
            else:
                cache[rows_B, :, cols_B] = qkv[:, heads:]
            q = qkv[:, :heads].reshape(batch, kv, heads // kv, dim)
            if attention is not None and lengths_B is not None:
                attn = attention(q, cache, lengths_B, self.scaling)
            else:
                attn = F.scaled_dot_product_attention(
                    q,
                    cache[:batch, :kv, :visible],
                    cache[:batch, kv:, :visible],
                    attn_mask=mask,
                    scale=self.scaling,
                )
            x = x + layer.o(attn.reshape(batch, heads * dim))
            gu = layer.gate_up(self._rms_norm(x, layer.norm_post))
            x = x + layer.down(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :])
        return self.lm_head(self._rms_norm(x, self.final_norm))

    def _step_pieces(
        self, ids_B: torch.Tensor, cols_B: torch.Tensor, caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """`step` with oneDNN's products (AMX tiles where the CPU has them) and the step
        kernel's code between them: norms, rotary, cache writes, attention, SwiGLU.

        The same operations in the same order as the whole-step kernel, with its bf16
        roundings; only the products' order of sums differs (oneDNN's blocking, not the
        kernel's). Four products and four calls into C a layer.
        """
        kernel = self.step_kernel
        assert kernel is not None and kernel.pieces is not None
        pieces = kernel.pieces
        kernel.check(caches, ids_B, cols_B, self.embed, self.final_norm,
                     self.lm_head.kernel_tensor(), self._cos, self._sin)
        batch = ids_B.shape[0]
        cols_B = cols_B.to(torch.int64).contiguous()
        heads, kv, eps, threads = self.heads, self.kv_heads, self.eps, torch.get_num_threads()
        x = F.embedding(ids_B, self.embed)
        h = torch.empty_like(x)
        attn = torch.empty(batch, heads * self.head_dim, dtype=self.dtype)
        act = torch.empty(batch, self.intermediate, dtype=self.dtype)
        pieces.add_norm(x, None, self.layers[0].norm_in, h, eps)
        norms_after = [after.norm_in for after in self.layers[1:]] + [self.final_norm]
        for layer, cache, norm_next in zip(self.layers, caches, norms_after, strict=True):
            qkv = layer.qkv(h)
            pieces.attend(qkv, cache, cols_B, self._cos, self._sin, heads, kv, self.scaling,
                          attn, threads)
            pieces.add_norm(x, layer.o(attn), layer.norm_post, h, eps)
            pieces.silu_mul(layer.gate_up(h), act)
            pieces.add_norm(x, layer.down(act), norm_next, h, eps)
        return self.lm_head(h)

    def prefill(
        self,
        ids_T: torch.Tensor,
        first: int,
        starts: list[int],
        lengths: list[int],
        caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Logits [N, vocab] of the token after each prompt; prompt i's KV goes to cache row
        first + i, columns starts[i] .. starts[i] + lengths[i].

        `ids_T` holds the N prompts' new tokens one after another (no padding); prompt i attends
        to the starts[i] columns its row already holds (a reused prefix, copied in) and
        causally to its own tokens. The products run on the T real tokens only; attention runs
        once per layer over the N rows, right-padded to the longest, with one additive mask.
        """
        self._refresh()
        if len(lengths) == 1:
            return self._prefill_one(ids_T, first, starts[0], caches)
        n, total = len(lengths), int(ids_T.shape[0])
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        qk = heads + kv
        width = max(lengths)
        visible = max(s + n_ for s, n_ in zip(starts, lengths, strict=True))
        device = ids_T.device
        lengths_N = torch.tensor(lengths, device=device)
        starts_N = torch.tensor(starts, device=device)
        seq_T = torch.repeat_interleave(torch.arange(n, device=device), lengths_N)
        offsets_N = torch.cumsum(lengths_N, 0) - lengths_N
        j_T = torch.arange(total, device=device) - offsets_N[seq_T]
        pos_T = starts_N[seq_T] + j_T
        row_T = seq_T + first
        slot_T = seq_T * width + j_T  # where token t sits in the right-padded [N, width] block
        cos = self._cos[pos_T][:, None, :]
        sin = self._sin[pos_T][:, None, :]
        # Slot j of row i is position starts[i] + j; it sees every column up to that position.
        # Padding slots (j >= lengths[i]) see column 0 only, so no row of scores is all -inf.
        cols_V = torch.arange(visible, device=device)
        slots_W = torch.arange(width, device=device)
        see = cols_V[None, None, :] <= (starts_N[:, None] + slots_W[None, :])[:, :, None]
        see &= (slots_W[None, :] < lengths_N[:, None])[:, :, None]
        see |= cols_V[None, None, :] == 0
        mask = torch.zeros(see.shape, dtype=self.dtype, device=device)
        mask = mask.masked_fill_(~see, float("-inf"))[:, None]
        q_S = torch.zeros(n * width, heads, dim, dtype=self.dtype, device=device)
        x = F.embedding(ids_T, self.embed)
        for layer, cache in zip(self.layers, caches, strict=True):
            qkv = layer.qkv(self._rms_norm(x, layer.norm_in)).view(total, qk + kv, dim)
            both = qkv[:, :qk]
            qkv[:, :qk] = both * cos + both.roll(dim // 2, -1) * sin
            cache[row_T, :, pos_T] = qkv[:, heads:]
            q_S[slot_T] = qkv[:, :heads]
            rows = cache[first : first + n]
            attn = F.scaled_dot_product_attention(
                q_S.view(n, width, heads, dim).transpose(1, 2),
                rows[:, :kv, :visible],
                rows[:, kv:, :visible],
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=heads != kv,
            )
            attn_T = attn.transpose(1, 2).reshape(n * width, heads * dim)[slot_T]
            x = x + layer.o(attn_T)
            gu = layer.gate_up(self._rms_norm(x, layer.norm_post))
            x = x + layer.down(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :])
        last_N = offsets_N + lengths_N - 1
        return self.lm_head(self._rms_norm(x[last_N], self.final_norm))

    def _prefill_one(
        self, ids_T: torch.Tensor, row: int, start: int, caches: list[torch.Tensor]
    ) -> torch.Tensor:
        """`prefill` of one prompt (or one chunk of a long one): attention without padding.

        A fresh prompt attends with SDPA's causal flag and no mask, which lets the flash kernel
        skip the blocks above the diagonal (2.5x less time than the same attention through a
        causal mask at 2k tokens, and attention is the quadratic part of a long prompt). A chunk
        after `start` cached columns attends through a [chunk, start + chunk] mask.
        """
        total = int(ids_T.shape[0])
        heads, kv, dim = self.heads, self.kv_heads, self.head_dim
        qk = heads + kv
        visible = start + total
        device = ids_T.device
        pos_T = torch.arange(start, visible, device=device)
        cos = self._cos[start:visible][:, None, :]
        sin = self._sin[start:visible][:, None, :]
        mask = None
        split = start > 0 and device.type == "cpu" and _FLASH_CPU is not None
        if start > 0 and not split:
            see = torch.arange(visible, device=device)[None, :] <= pos_T[:, None]
            mask = torch.zeros(see.shape, dtype=self.dtype, device=device)
            mask = mask.masked_fill_(~see, float("-inf"))
        x = F.embedding(ids_T, self.embed)
        for layer, cache in zip(self.layers, caches, strict=True):
            qkv = layer.qkv(self._rms_norm(x, layer.norm_in)).view(total, qk + kv, dim)
            both = qkv[:, :qk]
            qkv[:, :qk] = both * cos + both.roll(dim // 2, -1) * sin
            cache[row, :, start:visible] = qkv[:, heads:].transpose(0, 1)
            q = qkv[:, :heads].transpose(0, 1)[None]
            k, v = cache[row : row + 1, :kv, :visible], cache[row : row + 1, kv:, :visible]
            if split:
                attn = _attend_after_prefix(q, k, v, start, self.scaling)
            else:
                attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                      is_causal=mask is None, scale=self.scaling,
                                                      enable_gqa=heads != kv)
            x = x + layer.o(attn[0].transpose(0, 1).reshape(total, heads * dim))
            gu = layer.gate_up(self._rms_norm(x, layer.norm_post))
            x = x + layer.down(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :])
        return self.lm_head(self._rms_norm(x[-1:], self.final_norm))


_FLASH_CPU: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""torch's CPU flash attention, which returns each query's log-sum-exp with its output."""


def _attend_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                         scale: float) -> torch.Tensor:
    """Attention of a chunk's queries q [1, H, T, D] over `start` cached columns and, causally,
    over its own T (k, v [1, KV, start + T, D]): the same result as one pass through a
    [T, start + T] mask, to bf16 rounding, 1.5x faster on a 2k chunk after 18k columns.

    Two flash passes merged by their log-sum-exp: the cached columns need no mask at all, and
    the chunk's own columns take the causal flag. For the first, the query heads that share a
    KV head are stacked into one long query (rows are independent without a mask), so the
    prefix's K and V are read as they are, never expanded to every head.
    """
    _, heads, t, dim = q.shape
    kv = k.shape[1]
    group = heads // kv
    out1, lse1 = _FLASH_CPU(q.reshape(1, kv, group * t, dim), k[:, :, :start], v[:, :, :start],
                            scale=scale)[:2]
    out1, lse1 = out1.reshape(1, heads, t, dim), lse1.reshape(1, heads, t)
    own_k = k[:, :, start:].repeat_interleave(group, 1)  # T columns: a small copy
    own_v = v[:, :, start:].repeat_interleave(group, 1)
    out2, lse2 = _FLASH_CPU(q, own_k, own_v, is_causal=True, scale=scale)[:2]
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top)[..., None], torch.exp(lse2 - top)[..., None]
    return ((out1 * w1 + out2 * w2) / (w1 + w2)).to(q.dtype)


def _rope_tables(model: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sign-folded sin for every position, as transformers' rotary embedding makes them.

    `x * cos + roll(x, d/2) * sin_folded` equals `x * cos + rotate_half(x) * sin` bit for bit:
    rotate_half is cat(-x2, x1), roll is cat(x2, x1), and the sign moves onto the first half of
    sin (the table is cat(f, f), so both halves hold the same values).
    """
    inner: Any = model.model  # transformers' decoder stack (see LeanDecoder.__init__)
    rotary = inner.rotary_emb
    config: Any = model.config
    length = int(config.max_position_embeddings)
    positions = torch.arange(length, dtype=torch.float32)
    inv_freq = rotary.inv_freq.to(torch.float32).cpu()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    cos = (emb.cos() * scale).to(dtype)
    sin = (emb.sin() * scale).to(dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    device = inner.embed_tokens.weight.device
    return cos.to(device), sin.to(device)
