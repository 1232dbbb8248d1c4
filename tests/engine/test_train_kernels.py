"""The trainer's kernels (`csrc/train_kernels.c`): the bf16 -> fp32 product against float64
products, attention's one-pass softmax and its gradient against torch's, and what the RMSNorm and
SwiGLU kernels refuse (their values: tests/train/test_fused.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from relayrl.kernels import TrainKernels, train_kernels
from relayrl.kernels import cpu as cpu_kernels


def _has_bf16_units() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags.split()


BUILDABLE = _has_bf16_units() and shutil.which("cc") is not None


@pytest.fixture
def nt() -> TrainKernels:
    built = train_kernels()
    if built is None:
        pytest.skip("no C compiler, OpenMP or AVX512-BF16 here: the trainer's fp32 products "
                    "run on upcast copies")
    return built


def test_the_kernel_builds_where_the_machine_can_build_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert (train_kernels() is not None) == BUILDABLE


def _reference(a: torch.Tensor, w: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product and the float64 product of magnitudes (what rounding scales with)."""
    ref = scale * (a.double() @ w.double().transpose(-1, -2))
    size = abs(scale) * (a.double().abs() @ w.double().abs().transpose(-1, -2))
    return ref, size


@pytest.mark.parametrize("lead", [(), (2, 3)], ids=["2d", "batched"])
@pytest.mark.parametrize("m,n,k", [(1, 5, 2), (7, 16, 8), (13, 70, 64), (6, 129, 18)])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_the_product_keeps_fp32_sums(nt: TrainKernels, lead: tuple[int, ...], m: int, n: int,
                                     k: int, w_dtype: torch.dtype) -> None:
    # rows past a multiple of 6 and columns past a multiple of 16 or 64 are the tails
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(*lead, m, k, generator=g).bfloat16()
    w = torch.randn(*lead, n, k, generator=g).to(w_dtype)
    out = nt.product(a, w, 0.25)
    assert out.dtype == torch.float32 and out.shape == (*lead, m, n)
    ref, size = _reference(a, w, 0.25)
    # bf16 w: exact products, fp32 sums; fp32 w: its nearest bf16 plus the bf16 of the rest
    # keep 16 of its 24 bits (rounding the output to bf16 would be 4e-3 of it)
    bound = 1e-6 if w_dtype == torch.bfloat16 else 3e-5
    assert ((out.double() - ref).abs() <= bound * size + 1e-30).all()


def test_strided_operands_give_the_contiguous_product(nt: TrainKernels) -> None:
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 9, 40, generator=g).bfloat16()
    a = wide[:, :, 4:36]  # rows 40 apart
    w = torch.randn(4, 32, 11, generator=g).bfloat16().transpose(1, 2)  # K not contiguous
    torch.testing.assert_close(nt.product(a, w), nt.product(a.contiguous(), w.contiguous()), rtol=0, atol=0)
    torch.testing.assert_close(nt.product(a, w).double(), _reference(a, w, 1.0)[0], rtol=1e-5, atol=1e-5)


def test_empty_sides_give_empty_products(nt: TrainKernels) -> None:
    assert nt.product(torch.zeros(0, 8).bfloat16(), torch.zeros(5, 8).bfloat16()).shape == (0, 5)
    assert nt.product(torch.zeros(3, 8).bfloat16(), torch.zeros(0, 8).bfloat16()).shape == (3, 0)


@pytest.mark.parametrize("a,w", [
    (torch.zeros(3, 7), torch.zeros(4, 7)),  # K odd
    (torch.zeros(3, 8), torch.zeros(4, 6)),  # K differs
    (torch.zeros(2, 3, 8), torch.zeros(3, 4, 8)),  # batch differs
], ids=["odd-k", "k-differs", "batch-differs"])
def test_operands_the_kernel_does_not_take_are_refused(nt: TrainKernels, a: torch.Tensor,
                                                       w: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="cannot take"):
        nt.product(a.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match="cannot take"):
        nt.product(torch.zeros(3, 8), torch.zeros(4, 8).bfloat16())  # a in fp32


@pytest.mark.parametrize("keys", [5, 16, 37])  # a tail of a 16-lane vector, none, and both
@pytest.mark.parametrize("per_row_bias", [False, True], ids=["bias-L-K", "bias-R-1-L-K"])
def test_the_softmax_is_torchs_in_one_pass(nt: TrainKernels, keys: int,
                                           per_row_bias: bool) -> None:
    g = torch.Generator().manual_seed(keys)
    rows, heads, length = 3, 4, 6
    scores = torch.randn(rows, heads, length, keys, generator=g) * 8
    sees = torch.rand(rows if per_row_bias else 1, 1, length, keys, generator=g) < 0.6
    sees[..., 0] = True  # every query sees a key
    bias = torch.zeros(sees.shape).masked_fill_(~sees, float("-inf"))
    bias = bias if per_row_bias else bias[0, 0]
    want = torch.softmax(scores + bias, -1)
    p = nt.softmax(scores.clone(), bias)
    assert p.dtype == torch.bfloat16 and p.shape == scores.shape
    assert (p[(want == 0).expand_as(p)] == 0).all()  # masked keys get exactly nothing
    torch.testing.assert_close(p.float(), want, rtol=8e-3, atol=1e-6)  # bf16's own rounding


@pytest.mark.parametrize("keys", [5, 37])
def test_the_softmax_gradient_is_torchs_in_one_pass(nt: TrainKernels, keys: int) -> None:
    g = torch.Generator().manual_seed(keys)
    p = torch.softmax(torch.randn(2, 7, keys, generator=g), -1).bfloat16()
    d_p = torch.randn(2, 7, keys, generator=g)
    out, d_out = (torch.randn(2, 7, 32, generator=g).bfloat16() for _ in range(2))
    want = p.float() * (d_p - (d_out.float() * out.float()).sum(-1, keepdim=True))
    got = nt.softmax_grad(d_p, p, d_out, out)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=1e-6)


def test_softmax_operands_the_kernels_do_not_take_are_refused(nt: TrainKernels) -> None:
    scores = torch.zeros(2, 3, 4, 5)
    with pytest.raises(ValueError, match="cannot take"):
        nt.softmax(scores, torch.zeros(4, 6))  # keys differ
    with pytest.raises(ValueError, match="cannot take"):
        nt.softmax(scores.bfloat16(), torch.zeros(4, 5))
    p, d_p = torch.zeros(2, 5).bfloat16(), torch.zeros(2, 5)
    with pytest.raises(ValueError, match="cannot take"):
        nt.softmax_grad(d_p, p, torch.zeros(2, 8).bfloat16(), torch.zeros(2, 8).bfloat16())
    with pytest.raises(ValueError, match="cannot take"):
        nt.softmax_grad(d_p, p, torch.zeros(2, 16).bfloat16(), torch.zeros(2, 16))  # fp32 out


def test_norm_and_swiglu_operands_the_kernels_do_not_take_are_refused(nt: TrainKernels) -> None:
    x = torch.zeros(3, 24).bfloat16()
    with pytest.raises(ValueError, match="multiple of 16"):
        nt.rms_norm(x, torch.ones(24).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="contiguous bf16"):
        nt.rms_norm(torch.zeros(3, 32), torch.ones(32).bfloat16(), 1e-6)
    with pytest.raises(ValueError, match="contiguous bf16"):
        nt.swiglu(torch.zeros(4, 32).bfloat16().t(), torch.zeros(32, 4).bfloat16())
    with pytest.raises(ValueError, match="differ"):
        nt.swiglu(torch.zeros(4).bfloat16(), torch.zeros(5).bfloat16())


def test_rotary_operands_the_kernel_does_not_take_are_refused(nt: TrainKernels) -> None:
    x, cos = torch.zeros(1, 2, 5, 64).bfloat16(), torch.zeros(1, 5, 64).bfloat16()
    assert nt.rotary(x, cos, cos).shape == x.shape
    for bad_x, bad_cos in ((torch.zeros(1, 2, 5, 48).bfloat16(), torch.zeros(1, 5, 48).bfloat16()),
                           (x.float(), cos.float()),  # fp32
                           (x, torch.zeros(1, 6, 64).bfloat16()),  # positions for 6 tokens
                           (x, torch.zeros(2, 5, 64).bfloat16()),  # two rows of positions, one row
                           (x.transpose(2, 3), cos)):  # D not contiguous
        with pytest.raises(ValueError, match="cannot rotate"):
            nt.rotary(bad_x, bad_cos, bad_cos)
    with pytest.raises(ValueError, match="x's shape"):
        nt.rotary(x, cos, cos, out=torch.empty(1, 2, 5, 32).bfloat16())
