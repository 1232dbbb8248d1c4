"""`head_logprobs` against autograd's log_softmax: values and gradients, fp32 and bf16 heads."""

from __future__ import annotations

import pytest
import torch

from relayrl.train import head
from relayrl.train.head import head_logprobs


def reference(hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor,
              targets_N: torch.Tensor) -> torch.Tensor:
    logits_N_V = (hidden_N_H.to(weight_V_H.dtype) @ weight_V_H.t()).float()
    return logits_N_V.log_softmax(-1).gather(-1, targets_N[:, None])[:, 0]


def inputs(n: int, vocab: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, t


@pytest.mark.parametrize("hidden_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_bytes", [head.CHUNK_BYTES, 4 * 300 * 3])  # one slice; 3 rows a slice
def test_values_and_gradients_match_log_softmax(monkeypatch, chunk_bytes, hidden_dtype):
    monkeypatch.setattr(head, "CHUNK_BYTES", chunk_bytes)
    h, w, t = inputs(10, 300, 16, torch.float32)
    h = h.detach().to(hidden_dtype).requires_grad_()
    upstream = torch.randn(10, generator=torch.Generator().manual_seed(1))
    mine = head_logprobs(h, w, t)
    (mine * upstream).sum().backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = reference(h, w, t)
    (ref * upstream).sum().backward()
    assert mine.dtype == torch.float32  # fp32 logits whatever the hidden state's dtype
    # bf16 hidden states on an fp32 head: on CPUs with AVX512-BF16 the product runs on the bf16
    # units with the weight as two bf16 terms (16 of its 24 bits), ~1e-5 from the fp32 product
    torch.testing.assert_close(mine, ref, rtol=0,
                               atol=2e-6 if hidden_dtype == torch.float32 else 2e-5)
    assert grads[0].dtype == hidden_dtype and grads[1].dtype == torch.float32
    # the backward's products run in the hidden state's dtype: exact in fp32, bf16-rounded in bf16
    tol = {"rtol": 1e-5, "atol": 1e-6} if hidden_dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    torch.testing.assert_close(grads[0].float(), h.grad.float(), **tol)
    torch.testing.assert_close(grads[1], w.grad, **tol)


def test_a_second_backward_raises_instead_of_using_overwritten_probabilities():
    h, w, t = inputs(4, 50, 8, torch.float32)
    out = head_logprobs(h, w, t).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        out.backward()


def test_bf16_head_rounds_its_logits_like_the_head_does():
    h, w, t = inputs(6, 200, 16, torch.bfloat16)
    mine = head_logprobs(h, w, t)
    mine.sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(mine, reference(h, w, t).detach(), rtol=0, atol=1e-5)


def test_without_grad_is_the_same_number_and_keeps_no_graph():
    h, w, t = inputs(8, 300, 16, torch.float32)
    with torch.no_grad():
        plain = head_logprobs(h, w, t)
    assert plain.grad_fn is None
    torch.testing.assert_close(plain, head_logprobs(h, w, t).detach(), rtol=0, atol=0)


def test_no_rows():
    h, w, _ = inputs(0, 50, 8, torch.float32)
    assert head_logprobs(h, w, torch.zeros(0, dtype=torch.long)).shape == (0,)


@pytest.mark.parametrize("chunk_bytes", [head.CHUNK_BYTES, 4 * 300 * 3])
def test_a_bf16_twin_of_the_fp32_head_gives_the_same_gradients(monkeypatch, chunk_bytes):
    # The actor hands its bf16 copy's head to the backward instead of a fresh cast of the fp32
    # one: the same bits, so the same gradients, slice by slice or whole.
    monkeypatch.setattr(head, "CHUNK_BYTES", chunk_bytes)
    grads = []
    for twin in (False, True):
        h, w, t = inputs(10, 300, 16, torch.float32, seed=3)
        low = w.detach().to(torch.bfloat16) if twin else None
        head_logprobs(h, w, t, low).sum().backward()
        grads.append((h.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    h, w, t = inputs(4, 300, 16, torch.float32)
    with pytest.raises(ValueError, match="low_V_H"):
        head_logprobs(h, w, t, w.detach().half())


def test_the_logits_gradient_is_built_where_the_probabilities_are():
    # on CUDA a buffer made without a device would land on the CPU, beside GPU products
    probs = torch.softmax(torch.randn(5, 300, device="meta"), -1)
    out = head._logits_grad(probs, torch.zeros(5, dtype=torch.long, device="meta"),
                            torch.ones(5, device="meta"), torch.bfloat16)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16
