"""The trainer's C kernels under `torch.compile` (`train.compile` with a bf16 actor).

A kernel wrapper hands `t.data_ptr()` to C. Traced by dynamo, a buffer the wrapper allocates and
nothing but the kernel reads (the product's packing scratch) is freed before the kernel writes
into it, so the wrappers are kept out of dynamo's tracing (`opaque_to_compile`).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relayrl.kernels import TrainKernels, train_kernels

SRC = Path(__file__).resolve().parents[2] / "src"

# The product's scratch (`pack`, 64 columns of w a thread, fp32 w as two bf16 terms) is 64 MiB
# here: glibc maps an allocation that large on its own and unmaps it when it is freed, so a
# kernel writing into a freed scratch faults at once rather than corrupting the heap for later.
_COMPILED_PRODUCT = textwrap.dedent("""
    import torch
    from relayrl.kernels import train_kernels

    kernels = train_kernels()
    torch.manual_seed(0)
    k = 1 << 18
    a = torch.randn(1, 3, k).bfloat16()
    w = torch.randn(1, 2, k)

    def scores(a, w):
        return kernels.product(a, w, 0.5, threads=1) + 1

    eager = scores(a, w)
    compiled = torch.compile(scores, backend="eager")(a, w)
    assert torch.equal(compiled, eager), (compiled - eager).abs().max()
    print("same as eager")
""")


def _kernels() -> TrainKernels:
    kernels = train_kernels()
    if kernels is None:
        pytest.skip("no C compiler, OpenMP or AVX512-BF16 here: the trainer runs torch's ops")
    return kernels


def test_a_compiled_caller_of_the_product_gets_the_eager_result() -> None:
    _kernels()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-c", _COMPILED_PRODUCT], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert "same as eager" in proc.stdout


def test_every_wrapper_that_hands_pointers_to_c_is_kept_from_dynamo() -> None:
    wrappers = {name: fn for name, fn in vars(TrainKernels).items()
                if callable(fn) and "data_ptr()" in inspect.getsource(fn)}
    assert {"product", "softmax", "rms_norm_grad"} <= wrappers.keys()
    traced = [name for name, fn in wrappers.items()
              if not getattr(fn, "_torchdynamo_disable", False)]
    assert not traced, f"dynamo would trace {traced} (their buffers can die before the call)"
