"""The compiled CPU kernels: decode attention against torch's SDPA, the whole bf16 decode step
against the op-by-op step (both measured from an fp32 reference), the whole fp32 step (AVX2)
against the op-by-op fp32 step, how they are built and refused."""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from relayrl.engine.decoder import LeanDecoder
from relayrl.kernels import cpu as cpu_kernels
from relayrl.kernels.cpu import (
    DecodeAttention,
    DecodeStep,
    decode_attention_kernel,
    decode_step_kernel,
)


def _cpu_flags() -> set[str]:
    try:
        line = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


BUILDABLE = "avx512f" in _cpu_flags() and shutil.which("cc") is not None
F32_STEP_BUILDABLE = {"avx2", "fma"} <= _cpu_flags() and shutil.which("cc") is not None


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
    with caplog.at_level(logging.WARNING, logger="relayrl.kernels.cpu"):
        assert decode_attention_kernel() is None
    assert "torch's ops are used instead" in caplog.text
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


# -- the whole-step bf16 kernel ---------------------------------------------------------------


def _llama(seed: int, **overrides: object) -> torch.nn.Module:
    """A small random Llama (2 layers, grouped heads) whose every size the step kernel takes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    sizes = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=64, rms_norm_eps=1e-5)
    sizes.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    with torch.no_grad():  # larger than the init's 0.02, so rounding has something to round
        for p in model.parameters():
            p.mul_(3.0)
    return model


def _decode(lean: LeanDecoder, ids: torch.Tensor, starts: list[int], steps: int,
            cache_dtype: torch.dtype) -> list[torch.Tensor]:
    """fp32 logits of `steps` teacher-forced decode steps; row b writes columns starts[b]..."""
    batch = ids.shape[0]
    caches = [torch.zeros(batch + 2, 2 * lean.kv_heads, 64, lean.head_dim, dtype=cache_dtype)
              for _ in lean.layers]
    out = []
    for t in range(steps):
        cols = [s + t for s in starts]
        out.append(lean.step(ids[:, t], torch.tensor(cols), caches, max(cols) + 1, None,
                             cols).float())
    return out


@pytest.fixture
def step_kernel() -> DecodeStep:
    built = decode_step_kernel()
    if built is None:
        pytest.skip("no C compiler, OpenMP or AVX512-BF16 here: decoding runs op by op")
    return built


@pytest.mark.parametrize("batch", [1, 5, 8, 13])
def test_the_step_kernel_is_as_close_to_fp32_as_the_op_by_op_bf16_step(
    step_kernel: DecodeStep, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows at different columns (their caches hold earlier steps), batches that fill the
    # kernel's row groups (6) and its single-block tail: the same tokens through three steps,
    # fp32 op by op (the reference), bf16 op by op and bf16 in one kernel call.
    model = _llama(seed=batch)
    attention = decode_attention_kernel()
    exact = LeanDecoder(copy.deepcopy(model).float(), packed=False, attention=attention)
    bf16 = model.to(torch.bfloat16)
    ops = LeanDecoder(bf16, packed=False, attention=attention)
    fused = LeanDecoder(bf16, packed=False, attention=attention, step_kernel=step_kernel)
    assert fused.step_kernel is step_kernel and ops.step_kernel is None
    ids = torch.randint(0, 512, (batch, 12), generator=torch.Generator().manual_seed(batch))
    starts = [3 * b for b in range(batch)]
    reference = _decode(exact, ids, starts, 12, torch.float32)
    theirs = _decode(ops, ids, starts, 12, torch.bfloat16)

    def op_by_op(*args: object) -> None:
        raise AssertionError("the fused step ran an op-by-op norm")

    monkeypatch.setattr(LeanDecoder, "_rms_norm", op_by_op)
    ours = _decode(fused, ids, starts, 12, torch.bfloat16)
    for r, t, o in zip(reference, theirs, ours, strict=True):
        err_ops, err_fused = (t - r).abs().max(), (o - r).abs().max()
        assert err_fused <= 1.5 * err_ops + 0.02, (float(err_fused), float(err_ops))
        assert (o - t).abs().max() <= 4 * err_ops + 0.02
    # (Most often bit for bit: the products' fp32 sums differ in order, which rounding to bf16
    # mostly hides at these sizes; the default model's 49,152 logits show differences.)


def test_the_step_kernel_follows_in_place_weight_changes(step_kernel: DecodeStep) -> None:
    model = _llama(seed=7).to(torch.bfloat16)
    fused = LeanDecoder(model, packed=False, attention=decode_attention_kernel(),
                        step_kernel=step_kernel)
    ids = torch.randint(0, 512, (3, 4), generator=torch.Generator().manual_seed(0))
    before = _decode(fused, ids, [0, 1, 2], 4, torch.bfloat16)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
        model.model.layers[0].input_layernorm.weight.mul_(0.5)
    after = _decode(fused, ids, [0, 1, 2], 4, torch.bfloat16)
    ops = LeanDecoder(model, packed=False, attention=decode_attention_kernel())
    reference = _decode(ops, ids, [0, 1, 2], 4, torch.bfloat16)
    assert not torch.equal(before[-1], after[-1])
    for a, r in zip(after, reference, strict=True):
        assert (a - r).abs().max() <= 0.05 * r.abs().max()
    # A norm given new storage (not changed in place): the kernel must not read the old one.
    norm = model.model.layers[1].post_attention_layernorm.weight
    norm.data = norm.detach() * 2.0
    swapped = _decode(fused, ids, [0, 1, 2], 4, torch.bfloat16)
    swapped_ops = _decode(ops, ids, [0, 1, 2], 4, torch.bfloat16)
    assert not torch.equal(swapped[-1], after[-1])
    for a, r in zip(swapped, swapped_ops, strict=True):
        assert (a - r).abs().max() <= 0.05 * r.abs().max()


def test_models_the_step_kernel_does_not_take_decode_op_by_op(step_kernel: DecodeStep) -> None:
    attention = decode_attention_kernel()
    fp32 = LeanDecoder(_llama(seed=1), packed=False, attention=attention,
                       step_kernel=step_kernel)
    biased = LeanDecoder(_llama(seed=1, attention_bias=True).to(torch.bfloat16), packed=False,
                         attention=attention, step_kernel=step_kernel)
    odd = LeanDecoder(_llama(seed=1, hidden_size=72, head_dim=24, num_attention_heads=3,
                             num_key_value_heads=1).to(torch.bfloat16),
                      packed=False, attention=attention, step_kernel=step_kernel)
    assert [d.step_kernel for d in (fp32, biased, odd)] == [None] * 3
    # The step attends by itself: it needs no attention kernel beside it.
    alone = LeanDecoder(_llama(seed=1).to(torch.bfloat16), packed=False, step_kernel=step_kernel)
    assert alone.step_kernel is step_kernel


def test_the_step_kernel_refuses_bad_arguments(step_kernel: DecodeStep) -> None:
    model = _llama(seed=2).to(torch.bfloat16)
    fused = LeanDecoder(model, packed=False, attention=decode_attention_kernel(),
                        step_kernel=step_kernel)
    caches = [torch.zeros(2, 4, 16, 32, dtype=torch.bfloat16) for _ in fused.layers]
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="exceed"):
        fused.step(ids, torch.tensor([3, 16]), caches, 17, None, [3, 16])
    with pytest.raises(ValueError, match="exceed"):
        fused.step(torch.tensor([1, 2, 3]), torch.tensor([0, 0, 0]), caches, 1, None, [0, 0, 0])
    with pytest.raises(ValueError, match="bf16"):
        fused.step(ids, torch.tensor([0, 0]), [c.float() for c in caches], 1, None, [0, 0])
    with pytest.raises(ValueError, match="token ids"):
        fused.step(torch.tensor([1, 512]), torch.tensor([0, 0]), caches, 1, None, [0, 0])
    with pytest.raises(ValueError, match="cannot pack"):
        step_kernel.pack(torch.zeros(24, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot pack"):
        step_kernel.pack(torch.zeros(32, 8))  # fp32 is the other kernel's


# -- the whole-step fp32 kernel (AVX2 + FMA) ---------------------------------------------------


def test_the_fp32_step_kernel_builds_where_the_machine_can_build_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELAYRL_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    built = decode_step_kernel(torch.float32)
    assert (built is not None) == F32_STEP_BUILDABLE
    if built is not None:
        assert built.dtype == torch.float32
        assert len(list((tmp_path / "kernels").glob("decode_step_f32-*.so"))) == 1
        assert decode_step_kernel(torch.float32) is built
    assert decode_step_kernel(torch.float16) is None  # no kernel for other dtypes


@pytest.fixture
def f32_step_kernel() -> DecodeStep:
    built = decode_step_kernel(torch.float32)
    if built is None:
        pytest.skip("no C compiler, OpenMP or AVX2 + FMA here: fp32 decoding runs op by op")
    return built


def _decode_masked(lean: LeanDecoder, ids: torch.Tensor, starts: list[int],
                   steps: int) -> list[torch.Tensor]:
    """fp32 logits of teacher-forced steps, each row attending to its own prefix (the mask the
    engine gives; the fp32 op-by-op step without an attention kernel applies it through SDPA)."""
    batch = ids.shape[0]
    caches = [torch.zeros(batch + 2, 2 * lean.kv_heads, 64, lean.head_dim) for _ in lean.layers]
    out = []
    with torch.no_grad():
        for t in range(steps):
            cols = [s + t for s in starts]
            cols_B = torch.tensor(cols)
            visible = max(cols) + 1
            mask_B_V = torch.arange(visible)[None, :] <= cols_B[:, None]
            out.append(lean.step(ids[:, t], cols_B, caches, visible, mask_B_V, cols).clone())
    return out


@pytest.mark.parametrize("batch", [1, 4, 5, 13])
@pytest.mark.parametrize("odd_sizes", [False, True])
def test_the_fp32_step_kernel_equals_the_op_by_op_fp32_step(
    f32_step_kernel: DecodeStep, batch: int, odd_sizes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Batches that fill the kernel's row groups (4) and leave tails; with odd sizes every
    # product also ends in single blocks of 8 outputs (hidden 104, 2 x intermediate 400, the
    # q/k/v product 128 wide: none a multiple of the 24-output groups).
    sizes = (dict(hidden_size=104, intermediate_size=200, head_dim=16) if odd_sizes else {})
    model = _llama(seed=batch, **sizes)
    ops = LeanDecoder(model, packed=False)
    fused = LeanDecoder(model, packed=False, step_kernel=f32_step_kernel)
    assert fused.step_kernel is f32_step_kernel and ops.step_kernel is None
    ids = torch.randint(0, 512, (batch, 12), generator=torch.Generator().manual_seed(batch))
    starts = [3 * b for b in range(batch)]
    reference = _decode_masked(ops, ids, starts, 12)

    def op_by_op(*args: object) -> None:
        raise AssertionError("the fused step ran an op-by-op norm")

    monkeypatch.setattr(LeanDecoder, "_rms_norm", op_by_op)
    ours = _decode_masked(fused, ids, starts, 12)
    for r, o in zip(reference, ours, strict=True):
        assert o.dtype == torch.float32
        # Only the order of fp32 sums differs (measured: ~2e-6 of the logits' range).
        assert (o - r).abs().max() <= 1e-4 * max(1.0, float(r.abs().max()))


def test_the_fp32_step_kernel_follows_in_place_weight_changes(
    f32_step_kernel: DecodeStep,
) -> None:
    model = _llama(seed=7)
    fused = LeanDecoder(model, packed=False, step_kernel=f32_step_kernel)
    ids = torch.randint(0, 512, (3, 4), generator=torch.Generator().manual_seed(0))
    before = _decode_masked(fused, ids, [0, 1, 2], 4)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
        model.model.layers[0].input_layernorm.weight.mul_(0.5)
    after = _decode_masked(fused, ids, [0, 1, 2], 4)
    reference = _decode_masked(LeanDecoder(model, packed=False), ids, [0, 1, 2], 4)
    assert not torch.equal(before[-1], after[-1])
    for a, r in zip(after, reference, strict=True):
        assert (a - r).abs().max() <= 1e-4 * float(r.abs().max())


def test_the_fp32_step_kernel_refuses_bad_arguments(f32_step_kernel: DecodeStep) -> None:
    model = _llama(seed=2)
    fused = LeanDecoder(model, packed=False, step_kernel=f32_step_kernel)
    # A bf16 model is not the fp32 kernel's (nor is a biased one).
    assert LeanDecoder(_llama(seed=2).to(torch.bfloat16), packed=False,
                       step_kernel=f32_step_kernel).step_kernel is None
    assert LeanDecoder(_llama(seed=2, attention_bias=True), packed=False,
                       step_kernel=f32_step_kernel).step_kernel is None
    caches = [torch.zeros(2, 4, 16, 32) for _ in fused.layers]
    ids = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="exceed"):
        fused.step(ids, torch.tensor([3, 16]), caches, 17, None, [3, 16])
    with pytest.raises(ValueError, match="fp32"):
        fused.step(ids, torch.tensor([0, 0]), [c.bfloat16() for c in caches], 1, None, [0, 0])
    with pytest.raises(ValueError, match="token ids"):
        fused.step(torch.tensor([-1, 2]), torch.tensor([0, 0]), caches, 1, None, [0, 0])
    with pytest.raises(ValueError, match="cannot pack"):
        f32_step_kernel.pack(torch.zeros(12, 8))
