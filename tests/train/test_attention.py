"""The actor's CPU attention (`sdpa_gqa`) against transformers' own SDPA path."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from relayrl.train import attention


class _Layer(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("masked", [False, True])
def test_grouped_heads_give_transformers_numbers(masked):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 5, 8, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, generator=g, requires_grad=True)
    # a suffix of 5 tokens after a 4-token shared prefix: causal, aligned to the end
    mask = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None].expand(2, 1, 5, 9) if masked else None
    if not masked:
        k, v = k[:, :, :5].detach().requires_grad_(), v[:, :, :5].detach().requires_grad_()
    results = []
    for fn in (attention.sdpa_gqa, sdpa_attention_forward):
        out, _ = fn(_Layer(), q, k, v, mask, scaling=8 ** -0.5)
        out.square().sum().backward()
        results.append((out.detach(), *(t.grad.clone() for t in (q, k, v))))
        for t in (q, k, v):
            t.grad = None
    for mine, theirs in zip(*results, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_sdpa_resolves_to_relayrl_s_function_and_others_stay():
    assert attention.resolve("sdpa") == attention.GQA_SDPA
    assert attention.resolve("eager") == "eager"


PREFIX = 4
# Without stems: four pieces. With: piece 0 is a stem that pieces 1 and 2 continue, piece 3
# stands alone, piece 4 is a shorter stem that piece 5 continues.
LAYOUTS = {"pieces": ([5, 2, 7, 1], None), "stems": ([4, 5, 2, 3, 2, 3], [-1, 0, 0, -1, -1, 4])}


def _heads(heads: int, tokens: int, g: torch.Generator, token_major: bool) -> torch.Tensor:
    """A leaf `[1, heads, tokens, 8]`, laid out token by token in memory as a projection's
    output viewed as heads is, or head by head."""
    if token_major:
        x = torch.randn(1, tokens, heads, 8, generator=g).transpose(1, 2)
    else:
        x = torch.randn(1, heads, tokens, 8, generator=g)
    return x.requires_grad_()


@pytest.mark.parametrize("token_major", [True, False], ids=["token-major", "head-major"])
@pytest.mark.parametrize("split", [False, True], ids=["one-layout", "two-buckets"])
@pytest.mark.parametrize("case", list(LAYOUTS))
@pytest.mark.parametrize("prefix", [0, PREFIX])
@pytest.mark.parametrize("grouped_mask", [True, False], ids=["cpu-kernel", "heads-repeated"])
def test_unpadded_pieces_attend_as_their_own_rows_after_the_prefix_and_their_stem(
        prefix, grouped_mask, case, split, token_major, monkeypatch):
    # heads-repeated: the path taken where SDPA takes no mask with grouped heads (CUDA)
    monkeypatch.setattr(attention, "_masks_grouped_heads", lambda device: grouped_mask)
    pieces, stems = LAYOUTS[case]
    g = torch.Generator().manual_seed(1)
    s = sum(pieces)
    q = _heads(6, s, g, token_major)
    k, v = _heads(2, prefix + s, g, token_major), _heads(2, prefix + s, g, token_major)
    if split:  # by length, whatever it saves: a stem and its continuations may part
        layout = attention.buckets(pieces, prefix, torch.device("cpu"), stems, min_saving=0.0)
        assert isinstance(layout, tuple) and sorted(
            torch.cat([part.take_S for part in layout]).tolist()) == list(range(s))
    else:
        layout = attention.Unpadded.of(pieces, prefix, torch.device("cpu"), stems)
    if stems and not split:
        assert layout.stem == 4 and layout.mask.shape == (6, 1, 5, prefix + 4 + 5)
    out, _ = attention.sdpa_gqa(_Layer(), q, k, v, None, scaling=8 ** -0.5,
                                **{attention.UNPADDED: layout})
    assert out.shape == (1, s, 6, 8)
    # Each piece on its own: the prefix's keys, its stem's, then its own, causal.
    starts = [0]
    for n in pieces:
        starts.append(starts[-1] + n)
    want = []
    for i, n in enumerate(pieces):
        stem = stems[i] if stems else -1
        spans = [(0, prefix), *([(prefix + starts[stem], prefix + starts[stem + 1])]
                                if stem >= 0 else []), (prefix + starts[i], prefix + starts[i] + n)]
        keys = torch.cat([k[:, :, a:b] for a, b in spans], 2)
        values = torch.cat([v[:, :, a:b] for a, b in spans], 2)
        seen = keys.shape[2] - n
        mask = torch.ones(n, seen + n, dtype=torch.bool).tril(seen)
        want.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, starts[i]:starts[i] + n], keys.repeat_interleave(3, 1),
            values.repeat_interleave(3, 1), attn_mask=mask, scale=8 ** -0.5).transpose(1, 2))
    want_out = torch.cat(want, 1)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    # A stem's keys get the gradient of every piece that continues it.
    weights = torch.randn(out.shape, generator=g)
    grads = [torch.autograd.grad((o * weights).sum(), (q, k, v)) for o in (out, want_out)]
    for mine, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_keys_many_rows_take_sum_their_gradients_in_fp32_off_the_cpu():
    # CUDA's scatter adds in bf16 (a rounding per row taking the key); torch's CPU one sums in
    # fp32, so only reduced-precision tensors off the CPU take the widening gather.
    names = {}
    for device in ("meta", "cpu"):
        layout = attention.Unpadded.of([3, 2], 2, torch.device(device))
        for dtype in (torch.bfloat16, torch.float32):
            key = torch.zeros(1, 2, 7, 16, dtype=dtype, device=device, requires_grad=True)
            rows = attention._laid_out(key, layout, keys=True)
            assert rows.shape == (2, 2, 2 + 3, 16)
            names[device, dtype] = type(rows.grad_fn.next_functions[0][0]).__name__  # under the view
    assert names["meta", torch.bfloat16] == "_WideGatherBackward"
    assert {names["meta", torch.float32], names["cpu", torch.bfloat16],
            names["cpu", torch.float32]} == {"IndexSelectBackward0"}
    # 300 rows take row 0 after a 1: a bf16 running sum stays at 1, the fp32 one reaches 1.3
    flat = torch.zeros(2, 16, dtype=torch.bfloat16, requires_grad=True)
    index = torch.tensor([0] * 301 + [1])
    gathered = attention._WideGather.apply(flat, index)
    assert torch.equal(gathered, flat.detach().index_select(0, index))
    grad = torch.full(gathered.shape, 0.001, dtype=torch.bfloat16)
    grad[0] = 1.0
    gathered.backward(grad)
    exact = grad[:301].double().sum(0)
    assert flat.grad.dtype == torch.bfloat16
    assert torch.equal(flat.grad[0], exact.to(torch.bfloat16)) and flat.grad[0, 0] > 1.25
    assert torch.equal(flat.grad[1], grad[301])


def _bf16_case(unpadded: bool, scale: float = 1.0, dim: int = 16
               ) -> tuple[tuple[torch.Tensor, ...], Any]:
    """bf16 q, k, v (with grad) and a function running `sdpa_gqa` on them: over unpadded pieces
    with stems in two buckets, or a shared prefix's own causal pass (`rows`, no mask)."""
    g = torch.Generator().manual_seed(2)
    pieces, stems = LAYOUTS["stems"]
    s = sum(pieces) if unpadded else 9
    keys = PREFIX + s if unpadded else s
    q = (torch.randn(1, 6, s, dim, generator=g) * scale).bfloat16().requires_grad_()
    k = (torch.randn(1, 2, keys, dim, generator=g) * scale).bfloat16().requires_grad_()
    v = torch.randn(1, 2, keys, dim, generator=g).bfloat16().requires_grad_()
    extra = {attention.UNPADDED: attention.buckets(pieces, PREFIX, torch.device("cpu"), stems,
                                                   min_saving=0.0)} if unpadded else {}

    def run(*tensors: torch.Tensor) -> torch.Tensor:
        return attention.sdpa_gqa(_Layer(), *tensors, None, scaling=8 ** -0.5, **extra)[0]

    return (q, k, v), run


def _recording_sdpa(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtypes of the queries SDPA is called with, from now on."""
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def recording(query: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(query.dtype)
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    return seen


def _relative_errors(run: Any, tensors: tuple[torch.Tensor, ...]) -> list[float]:
    """Relative L2 errors of the output and of q's, k's and v's gradients against float64."""
    weights = torch.randn(run(*tensors).shape, generator=torch.Generator().manual_seed(3))
    results = []
    for dtype in (None, torch.float64):
        leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
        out = run(*leaves)
        grads = torch.autograd.grad((out.to(weights.dtype) * weights).sum(), leaves)
        results.append([out.double(), *(x.double() for x in grads)])
    return [((a - b).norm() / b.norm()).item() for a, b in zip(*results, strict=True)]


@pytest.mark.parametrize("kernels", [True, False], ids=["our-kernels", "torch-ops"])
@pytest.mark.parametrize("dim", [8, 16], ids=["d8", "d16"])
@pytest.mark.parametrize("unpadded", [False, True], ids=["prefix-pass", "unpadded"])
def test_bf16_attention_on_cpu_is_bf16_products_with_fp32_scores(unpadded, dim, kernels,
                                                                  monkeypatch):
    # torch's CPU flash kernel does not use the bf16 units, and its bf16 backward queues for the
    # one glibc arena a training process keeps; explicit products do and allocate outside it.
    # Our kernels (kernels/csrc/train_kernels.c, where built: AVX512-BF16) or torch's ops; the
    # softmax gradient's kernel takes head dims that are multiples of 16.
    if not kernels:
        monkeypatch.setattr(attention, "train_kernels", lambda: None)
    seen = _recording_sdpa(monkeypatch)
    tensors, run = _bf16_case(unpadded, 3.0, dim)  # scores of +-20: bf16 scores would show
    out = run(*tensors)
    with torch.no_grad():
        scored = run(*tensors)
    assert seen == [] and out.dtype == torch.bfloat16
    # a policy scored without grad gives the update's numbers for the same weights
    torch.testing.assert_close(scored, out, rtol=0, atol=0)
    # Against float64, at scores of +-20: fp32 SDPA's output is off by 0.9-1.4e-3 (its rounding
    # to bf16), ours by 1.3-1.8e-3, with the scores rounded to bf16 by 5e-3. As GPU flash
    # kernels do, dS goes to bf16 for its products with q and k: 7-11e-3 in those gradients
    # (fp32 SDPA 2-4e-3); the default model's logprobs and gradients differ from an fp32
    # model's as much either way (benchmarks/RESULTS.md).
    out_error, *grad_errors = _relative_errors(run, tensors)
    assert out_error < 3e-3 and max(grad_errors) < 1.5e-2, (out_error, grad_errors)
    out.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in tensors)


@pytest.mark.parametrize("unpadded", [False, True], ids=["prefix-pass", "unpadded"])
def test_bf16_attention_too_large_for_its_products_runs_sdpa_in_fp32(unpadded, monkeypatch):
    # the probabilities kept for the backward are bounded; flash kernels keep none
    seen = _recording_sdpa(monkeypatch)
    tensors, run = _bf16_case(unpadded)
    products = run(*tensors)
    monkeypatch.setattr(attention, "MATMUL_MAX_BYTES", 0)
    out = run(*tensors)
    in_fp32 = run(*(t.float() for t in tensors))
    calls = 2 if unpadded else 1  # unpadded: two length buckets, an SDPA call each
    assert seen == [torch.float32] * 2 * calls and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, in_fp32.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), products.float(), rtol=2e-2, atol=2e-2)
    assert max(_relative_errors(run, tensors)) < 4e-3
    monkeypatch.setattr(attention, "UPCAST_ON_CPU", False)
    with torch.no_grad():
        run(*tensors)
    assert seen[-1] == torch.bfloat16


def test_buckets_split_by_length_only_where_it_saves_padded_work():
    cpu = torch.device("cpu")
    # one long piece among short ones: padding every piece to it would triple the work
    short, long_ = attention.buckets([3, 2, 30, 3], 4, cpu)
    assert (short.rows, short.longest, long_.rows, long_.longest) == (3, 3, 1, 30)
    assert short.take_S.tolist() == [0, 1, 2, 3, 4, 35, 36, 37] and long_.take_S.tolist() == list(range(5, 35))
    # pieces of one length: nothing to save
    assert isinstance(attention.buckets([5, 5, 5, 5], 4, cpu), attention.Unpadded)
    assert isinstance(attention.buckets([7], 4, cpu), attention.Unpadded)
