"""LeanDecoder against the model's own forward: same tokens, same logprobs, same weight updates,
for its decode step and for its prefill (fresh prompts and prompts that reuse cached KV)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from relayrl.engine.decoder import LeanDecoder
from relayrl.engine.loading import describe_decode_path
from relayrl.engine.local import LocalEngine
from relayrl.kernels import decode_attention_kernel, decode_step_kernel
from relayrl.types import GenerateOutput, GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

BF16_LOGPROB_BOUND = 0.25
"""bf16 lean step vs the model's forward (as tests/engine/test_local_engine.py bounds a bf16
engine against a fresh bf16 forward)."""
PROMPTS = ["Hi", "Explain in one sentence why the sky is blue.", "List two colours, then stop."]


def requests(engine: LocalEngine, lengths: list[int]) -> list[GenerateRequest]:
    """One request per prompt, `lengths[i]` new tokens, greedy and sampled alternately."""
    reqs = []
    for i, (text, n) in enumerate(zip(PROMPTS, lengths, strict=True)):
        rendered = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        ids = engine.tokenizer.encode(rendered, add_special_tokens=False)
        params = SamplingParams(max_new_tokens=n, temperature=0.8 * (i % 2), seed=i)
        reqs.append(GenerateRequest(ids, params))
    return reqs


def engine_with(model_dir: str, dtype: str, max_context: int, *, lean: bool = True,
                lean_prefill: bool = True, kernel: bool = True, fused: bool = True) -> LocalEngine:
    """A CPU engine on one thread whose decode path is set here, not picked as fastest: through
    `LeanDecoder` or the model's forward, with or without the compiled kernels."""
    engine = LocalEngine(model_dir, device="cpu", dtype=dtype, max_context=max_context,
                         num_threads=1)
    # No request has reached the engine thread yet, so nothing has read these.
    engine.lean = LeanDecoder.build(
        engine.model, packed=engine.packed_linears > 0,
        attention=decode_attention_kernel() if kernel else None,
        step_kernel=decode_step_kernel(engine.dtype) if kernel and fused else None,
    ) if lean else None
    engine.lean_prefill = lean_prefill and engine.lean is not None
    engine.decode_path = describe_decode_path(engine.lean)
    return engine


async def run(engine: LocalEngine, lengths: list[int]) -> list[GenerateOutput]:
    """The prompts together (rows of different lengths: masked attention), greedy and sampled."""
    return list(await asyncio.gather(*map(engine.generate, requests(engine, lengths))))


@pytest.mark.parametrize(
    ("dtype", "kernel", "fused"),
    [("float32", False, False), ("float32", True, False), ("float32", True, True),
     ("bfloat16", False, False)],
)
async def test_lean_decode_gives_the_model_forwards_tokens_and_logprobs(
    model_dir: str, dtype: str, kernel: bool, fused: bool
) -> None:
    # The prefill stays the model's. In fp32 every decode path (torch's attention, the
    # decode-attention kernel, the whole-step kernel) must give the model's tokens, and its
    # logprobs to 1e-4. In bf16 the lean step and the model's forward call torch's kernels with
    # other shapes, which some CPUs round differently (bit-equal on an AVX512-BF16 EPYC with
    # torch 2.13, up to 0.16 nats apart on an AMX Xeon with torch 2.11): the tokens must agree
    # until the first one drawn differently, with logprobs within the bf16 bound up to there.
    # The bf16 kernels' rounding is checked in test_cpu_kernels.
    if kernel and not fused and decode_attention_kernel() is None:
        pytest.skip("no decode-attention kernel on this machine (no C compiler or no AVX-512)")
    if fused and decode_step_kernel(torch.float32) is None:
        pytest.skip("no fp32 step kernel on this machine (no C compiler, OpenMP or AVX2 + FMA)")
    lean = engine_with(model_dir, dtype, 256, lean_prefill=False, kernel=kernel, fused=fused)
    plain = engine_with(model_dir, dtype, 256, lean=False)
    try:
        assert lean.lean is not None and plain.lean is None
        assert (lean.lean.step_kernel is not None) == fused
        if not fused:
            assert (lean.lean.attention is not None) == kernel
        assert ("compiled" in lean.decode_path) == kernel  # what the engine logs at start
        assert plain.decode_path == "through the model's forward"
        lengths = [20, 7, 13]
        a, b = await run(lean, lengths), await run(plain, lengths)
        # In-place new weights reach the fused products (and the old ones come back).
        name = "model.layers.1.self_attn.k_proj.weight"
        saved = lean.model.state_dict()[name].clone()
        noise = torch.randn(saved.shape, generator=torch.Generator().manual_seed(0))
        noisy = {name: saved + 0.05 * noise.to(saved.dtype)}
        await asyncio.gather(lean.update_weights(noisy), plain.update_weights(noisy))
        a2, b2 = await run(lean, lengths), await run(plain, lengths)
        await lean.update_weights({name: saved})
        a3 = await run(lean, lengths)
    finally:
        await asyncio.gather(lean.aclose(), plain.aclose())
    assert [o.output_ids for o in a3] == [o.output_ids for o in a]  # same engine, same path
    assert any(x.logprobs != y.logprobs for x, y in zip(a2, a, strict=True))
    if dtype == "float32":
        assert [o.output_ids for o in a] == [o.output_ids for o in b]
        assert [o.output_ids for o in a2] == [o.output_ids for o in b2]
    bound = 1e-4 if dtype == "float32" else BF16_LOGPROB_BOUND
    agreed = 0
    for x, y in zip([*a, *a2], [*b, *b2], strict=True):
        pairs = list(zip(x.output_ids, y.output_ids, strict=False))  # may end apart once apart
        same = next((i for i, (p, q) in enumerate(pairs) if p != q), len(pairs))
        assert same >= 1  # the first token comes from the same (the model's) prefill
        head = zip(x.logprobs[:same], y.logprobs[:same], strict=True)
        assert max(abs(p - q) for p, q in head) <= bound
        agreed += same
    # A broken step would part from the model's at its first token in most rows.
    assert agreed >= sum(len(o.output_ids) for o in [*a, *a2]) / 2


async def test_lean_prefill_gives_the_model_forwards_tokens_and_logprobs(model_dir: str) -> None:
    """fp32: the unpadded prefill equals the model's padded one, fresh and after reused columns."""
    lean = LocalEngine(model_dir, device="cpu", dtype="float32", max_context=512, num_threads=1)
    plain = engine_with(model_dir, "float32", 512, lean=False)
    try:
        assert lean.lean_prefill and not plain.lean_prefill
        lengths = [20, 7, 13]
        a, b = await run(lean, lengths), await run(plain, lengths)
        # Next turns: each prompt extends a finished sequence (its KV is reused), in one batch
        # with a prompt that matches nothing cached (a fresh prefill beside the reused one).
        first = [list(r.prompt_ids) for r in requests(lean, lengths)]
        prompts = [[*p, *o.output_ids, *p[-18:]] for p, o in zip(first, a, strict=True)]
        prompts.append(first[0][::-1])
        params = SamplingParams(max_new_tokens=9, temperature=0)
        reqs = [GenerateRequest(p, params) for p in prompts]
        reused_before = lean.prefix_stats.reused_tokens  # type: ignore[union-attr]
        a2 = await asyncio.gather(*map(lean.generate, reqs))
        b2 = await asyncio.gather(*map(plain.generate, reqs))
        reused = lean.prefix_stats.reused_tokens - reused_before  # type: ignore[union-attr]
    finally:
        await asyncio.gather(lean.aclose(), plain.aclose())
    assert reused >= sum(map(len, first))  # the reuse path did run
    assert [o.output_ids for o in [*a, *a2]] == [o.output_ids for o in [*b, *b2]]
    for x, y in zip([*a, *a2], [*b, *b2], strict=True):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= 1e-4


def test_architectures_it_does_not_reproduce_keep_the_models_forward() -> None:
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32)
    assert LeanDecoder.build(GPT2LMHeadModel(config).eval(), packed=False) is None


def test_the_bf16_step_kernel_on_the_default_model_is_as_close_to_fp32_as_op_by_op(
    model_dir: str,
) -> None:
    """The compiled whole-step kernel (bf16, the engine's default here) against fp32."""
    from transformers import AutoModelForCausalLM

    kernel, attention = decode_step_kernel(), decode_attention_kernel()
    if kernel is None or attention is None:
        pytest.skip("no C compiler, OpenMP or AVX512-BF16 here: decoding runs op by op")
    exact_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    exact = LeanDecoder(exact_model, packed=False, attention=attention)
    ops = LeanDecoder(model, packed=True, attention=attention)
    fused = LeanDecoder(model, packed=True, attention=attention, step_kernel=kernel)
    assert fused.step_kernel is kernel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenizer.encode(p) for p in [*PROMPTS, "What is 17 * 23? Use the multiply tool."]]
    ids = torch.tensor([(r * 12)[:12] for r in rows])
    starts = [0, 5, 9, 2]  # rows at different columns

    def decode(lean: LeanDecoder, dtype: torch.dtype) -> torch.Tensor:
        caches = [torch.zeros(4, 2 * lean.kv_heads, 32, lean.head_dim, dtype=dtype)
                  for _ in lean.layers]
        out = []
        with torch.no_grad():
            for t in range(ids.shape[1]):
                cols = [s + t for s in starts]
                out.append(lean.step(ids[:, t], torch.tensor(cols), caches, max(cols) + 1,
                                     None, cols).float())
        return torch.stack(out)

    reference = decode(exact, torch.float32)
    theirs, ours = decode(ops, torch.bfloat16), decode(fused, torch.bfloat16)
    # bf16 through 30 layers moves logits by ~0.3-0.8 on average, either way; over 48 steps the
    # kernel's distance from fp32 must be the op-by-op step's (measured: 1.0-1.1x).
    err_ops, err_fused = (theirs - reference).abs().mean(), (ours - reference).abs().mean()
    print(f"mean |logit - fp32|: op by op {float(err_ops):.3f}, kernel {float(err_fused):.3f}")
    assert err_fused <= 1.25 * err_ops, (float(err_fused), float(err_ops))
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree >= (theirs.argmax(-1) == reference.argmax(-1)).float().mean() - 0.1
    assert not torch.equal(theirs, ours)  # the kernel did run: its sums differ in order


@pytest.mark.parametrize("kv", [2, 14])
def test_a_chunk_after_a_prefix_attends_as_through_one_causal_mask(kv: int) -> None:
    from relayrl.engine.decoder import _FLASH_CPU, _attend_after_prefix

    if _FLASH_CPU is None:
        pytest.skip("this torch has no CPU flash attention op")
    gen = torch.Generator().manual_seed(0)
    heads, dim, start, t = 14, 64, 300, 77
    q = torch.randn(1, heads, t, dim, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, kv, start + t, dim, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, kv, start + t, dim, generator=gen).to(torch.bfloat16)
    see = torch.arange(start + t)[None, :] <= torch.arange(start, start + t)[:, None]
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=see,
                                          scale=0.125, enable_gqa=kv != heads)
    got = _attend_after_prefix(q, k, v, start, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # outputs up to ~0.5: bf16 rounding is ~2e-3 (leaving out the chunk's own columns: 0.3)
    assert (got.float() - want).abs().max().item() < 8e-3
