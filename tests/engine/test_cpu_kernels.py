"""The compiled decode-attention kernel against torch's SDPA, and how it is built and refused."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from relayrl.engine import cpu_kernels
from relayrl.engine.cpu_kernels import DecodeAttention, decode_attention_kernel


def _has_avx512() -> bool:
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return False
    return " avx512f" in flags


BUILDABLE = _has_avx512() and shutil.which("cc") is not None


@pytest.fixture
def kernel() -> DecodeAttention:
    built = decode_attention_kernel()
    if built is None:
        pytest.skip("this machine has no C compiler or no AVX-512: the engine keeps torch's SDPA")
    return built


def test_the_kernel_builds_where_the_machine_can_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # From scratch: an empty cache directory, nothing loaded in this process.
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    built = decode_attention_kernel()
    assert (built is not None) == BUILDABLE
    if BUILDABLE:
        assert len(list((tmp_path / "kernels").glob("decode_attention-*.so"))) == 1
        assert decode_attention_kernel() is built  # once per process


def test_a_failed_build_leaves_torchs_attention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="relayrl.engine.cpu_kernels"):
        assert decode_attention_kernel() is None
    assert "keeps torch's attention" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # no half-written library left
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.delenv("CC")
    monkeypatch.setenv("RELAYRL_NO_CPU_KERNELS", "1")
    assert decode_attention_kernel() is None


def _case(
    batch: int, kv: int, groups: int, dim: int, lengths: list[int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, an engine-layout cache with spare rows and columns, and int64 lengths."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(batch + 3, 2 * kv, max(lengths) + 11, dim, generator=g).to(dtype)
    q = torch.randn(batch, kv, groups, dim, generator=g).to(dtype)
    return q, cache, torch.tensor(lengths, dtype=torch.int64)


def _reference(q: torch.Tensor, cache: torch.Tensor, lengths: torch.Tensor, scale: float):
    """SDPA in fp32 with the prefix mask the engine builds."""
    batch, kv = q.shape[:2]
    visible = int(lengths.max())
    keep = torch.arange(visible)[None, :] < lengths[:, None]
    return F.scaled_dot_product_attention(
        q.float(),
        cache[:batch, :kv, :visible].float(),
        cache[:batch, kv:, :visible].float(),
        attn_mask=keep[:, None, None, :],
        scale=scale,
    )


SHAPES = [
    # batch, kv heads, query rows per kv head, head_dim, lengths
    (1, 3, 3, 64, [1]),  # SmolLM2's heads, a single column
    (5, 3, 3, 64, [150, 17, 150, 33, 64]),  # rows of unequal length
    (4, 2, 4, 64, [40, 39, 16, 200]),
    (2, 2, 7, 64, [300, 5]),  # Qwen2-0.5B's grouping
    (3, 2, 8, 128, [12, 77, 129]),
    (2, 4, 1, 32, [9, 30]),  # no grouping, a head_dim with no unrolled copy
    (2, 1, 5, 48, [15, 16]),
]


@pytest.mark.parametrize(("batch", "kv", "groups", "dim", "lengths"), SHAPES)
def test_fp32_equals_sdpa_over_each_rows_prefix(
    kernel: DecodeAttention, batch: int, kv: int, groups: int, dim: int, lengths: list[int]
) -> None:
    q, cache, lengths_B = _case(batch, kv, groups, dim, lengths, torch.float32, seed=batch)
    out = kernel(q, cache, lengths_B, dim**-0.5)
    torch.testing.assert_close(out, _reference(q, cache, lengths_B, dim**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("batch", "kv", "groups", "dim", "lengths"), SHAPES)
def test_bf16_is_no_further_from_fp32_than_sdpa_in_bf16(
    kernel: DecodeAttention, batch: int, kv: int, groups: int, dim: int, lengths: list[int]
) -> None:
    q, cache, lengths_B = _case(batch, kv, groups, dim, lengths, torch.bfloat16, seed=batch)
    exact = _reference(q, cache, lengths_B, dim**-0.5)
    out = kernel(q, cache, lengths_B, dim**-0.5)
    visible = int(lengths_B.max())
    keep = torch.arange(visible)[None, :] < lengths_B[:, None]
    mask = torch.zeros(keep.shape, dtype=torch.bfloat16).masked_fill_(~keep, float("-inf"))
    sdpa = F.scaled_dot_product_attention(
        q, cache[:batch, :kv, :visible], cache[:batch, kv:, :visible],
        attn_mask=mask[:, None, None, :], scale=dim**-0.5,
    )
    assert out.dtype == torch.bfloat16
    ours, theirs = (out.float() - exact).abs().max(), (sdpa.float() - exact).abs().max()
    # Scores and weights stay fp32 here; only the output is rounded (half an ulp of bf16).
    assert ours <= theirs + 1e-6
    assert ours <= exact.abs().max() * 2**-8


def test_columns_past_a_rows_length_are_never_read(kernel: DecodeAttention) -> None:
    q, cache, lengths_B = _case(2, 3, 3, 64, [20, 7], torch.float32, seed=3)
    before = kernel(q, cache, lengths_B, 0.125)
    cache[0, :, 20:] = float("nan")
    cache[1, :, 7:] = float("nan")
    cache[2:] = float("nan")  # rows past the batch too
    torch.testing.assert_close(kernel(q, cache, lengths_B, 0.125), before, atol=0, rtol=0)


def test_bad_arguments_are_refused_before_the_kernel_runs(kernel: DecodeAttention) -> None:
    q, cache, lengths_B = _case(2, 3, 3, 64, [20, 7], torch.float32, seed=4)
    with pytest.raises(ValueError, match="dtype"):
        kernel(q, cache.to(torch.bfloat16), lengths_B, 0.125)
    with pytest.raises(ValueError, match="int64"):
        kernel(q, cache, lengths_B.to(torch.int32), 0.125)
    with pytest.raises(ValueError, match="exceed"):
        kernel(q, cache, torch.tensor([20, cache.shape[2] + 1]), 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        kernel(q, cache.transpose(2, 3), lengths_B, 0.125)
    assert not kernel.supports(torch.float16, 3, 64)
    assert not kernel.supports(torch.float32, 3, 72)
    assert not kernel.supports(torch.float32, 17, 64)
