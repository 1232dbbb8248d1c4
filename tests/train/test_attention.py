"""The actor's CPU attention (`sdpa_gqa`) against transformers' own SDPA path."""

from __future__ import annotations

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


def test_cpu_sdpa_resolves_to_the_grouped_kernel_and_others_stay():
    assert attention.resolve("sdpa", torch.device("cpu")) == attention.GQA_SDPA
    assert attention.resolve("sdpa", torch.device("cuda")) == "sdpa"
    assert attention.resolve("eager", torch.device("cpu")) == "eager"
