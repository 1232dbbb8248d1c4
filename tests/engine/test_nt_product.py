"""The trainer's bf16 -> fp32 product kernel (`csrc/nt_product.c`) against float64 products."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from relayrl.engine import cpu_kernels
from relayrl.engine.cpu_kernels import NtProduct, nt_product_kernel


def _has_bf16_units() -> bool:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags.split()


BUILDABLE = _has_bf16_units() and shutil.which("cc") is not None


@pytest.fixture
def nt() -> NtProduct:
    built = nt_product_kernel()
    if built is None:
        pytest.skip("no C compiler, OpenMP or AVX512-BF16 here: the trainer's fp32 products "
                    "run on upcast copies")
    return built


def test_the_kernel_builds_where_the_machine_can_build_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    assert (nt_product_kernel() is not None) == BUILDABLE


def _reference(a: torch.Tensor, w: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product and the float64 product of magnitudes (what rounding scales with)."""
    ref = scale * (a.double() @ w.double().transpose(-1, -2))
    size = abs(scale) * (a.double().abs() @ w.double().abs().transpose(-1, -2))
    return ref, size


@pytest.mark.parametrize("lead", [(), (2, 3)], ids=["2d", "batched"])
@pytest.mark.parametrize("m,n,k", [(1, 5, 2), (7, 16, 8), (13, 70, 64), (6, 129, 18)])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_the_product_keeps_fp32_sums(nt: NtProduct, lead: tuple[int, ...], m: int, n: int,
                                     k: int, w_dtype: torch.dtype) -> None:
    # rows past a multiple of 6 and columns past a multiple of 16 or 64 are the tails
    g = torch.Generator().manual_seed(m * n + k)
    a = torch.randn(*lead, m, k, generator=g).bfloat16()
    w = torch.randn(*lead, n, k, generator=g).to(w_dtype)
    out = nt(a, w, 0.25)
    assert out.dtype == torch.float32 and out.shape == (*lead, m, n)
    ref, size = _reference(a, w, 0.25)
    # bf16 w: exact products, fp32 sums; fp32 w: its nearest bf16 plus the bf16 of the rest
    # keep 16 of its 24 bits (rounding the output to bf16 would be 4e-3 of it)
    bound = 1e-6 if w_dtype == torch.bfloat16 else 3e-5
    assert ((out.double() - ref).abs() <= bound * size + 1e-30).all()


def test_strided_operands_give_the_contiguous_product(nt: NtProduct) -> None:
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 9, 40, generator=g).bfloat16()
    a = wide[:, :, 4:36]  # rows 40 apart
    w = torch.randn(4, 32, 11, generator=g).bfloat16().transpose(1, 2)  # K not contiguous
    torch.testing.assert_close(nt(a, w), nt(a.contiguous(), w.contiguous()), rtol=0, atol=0)
    torch.testing.assert_close(nt(a, w).double(), _reference(a, w, 1.0)[0], rtol=1e-5, atol=1e-5)


def test_empty_sides_give_empty_products(nt: NtProduct) -> None:
    assert nt(torch.zeros(0, 8).bfloat16(), torch.zeros(5, 8).bfloat16()).shape == (0, 5)
    assert nt(torch.zeros(3, 8).bfloat16(), torch.zeros(0, 8).bfloat16()).shape == (3, 0)


@pytest.mark.parametrize("a,w", [
    (torch.zeros(3, 7), torch.zeros(4, 7)),  # K odd
    (torch.zeros(3, 8), torch.zeros(4, 6)),  # K differs
    (torch.zeros(2, 3, 8), torch.zeros(3, 4, 8)),  # batch differs
], ids=["odd-k", "k-differs", "batch-differs"])
def test_operands_the_kernel_does_not_take_are_refused(nt: NtProduct, a: torch.Tensor,
                                                       w: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="cannot take"):
        nt(a.bfloat16(), w.bfloat16())
    with pytest.raises(ValueError, match="cannot take"):
        nt(torch.zeros(3, 8), torch.zeros(4, 8).bfloat16())  # a in fp32
