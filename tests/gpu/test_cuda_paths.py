"""The CUDA paths of LocalEngine and Actor on the real default model: exact fp32 decoding, bf16
by default, batching invariance, weights pushed from a GPU actor, and a GPU update that agrees
with the CPU one, for unpadded and padded micro-batches, shared prefixes and the SFT replay.

CI has no GPU, so these are skipped there; on a GPU machine run `python -m pytest -m gpu`.
`RELAYRL_TEST_DEVICE=cpu` runs the same checks on the CPU (to check the tests themselves).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

# engine.* and train.* are the sibling test packages (pytest puts tests/ on sys.path)
from engine.test_local_engine import check_mid_stream_update
from relayrl.engine.local import LocalEngine
from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch
from relayrl.types import GenerateOutput, GenerateRequest, SamplingParams
from train.test_real_step import one_group
from train.test_shared_prefix import LONG_QUESTION, QUESTION, agent_batch

DEVICE = os.environ.get("RELAYRL_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (run `python -m pytest -m gpu` on a GPU machine)"),
]

CONTEXT = 256
FP32_LOGPROB_BOUND = 1e-3
"""fp32 engine vs a fresh fp32 forward pass: cuBLAS picks other kernels (other summation orders)
for a one-token decode step than for a whole sequence."""
BF16_LOGPROB_BOUND = 0.25
"""bf16 engine vs a fresh bf16 forward pass (as in tests/engine/test_local_engine.py)."""


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[LocalEngine]:
    """An fp32 engine on the device, shared by the module."""
    e = LocalEngine(model_dir, device=DEVICE, dtype="float32", seed=0, max_context=CONTEXT)
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(model_dir: str) -> torch.nn.Module:
    """The model loaded on its own in fp32 on the device: shares nothing with the engine."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()


def chat(engine: LocalEngine, text: str) -> list[int]:
    """Prompt ids of one user turn in the model's chat template."""
    rendered = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def request(ids: list[int], **params: object) -> GenerateRequest:
    return GenerateRequest(prompt_ids=ids, params=SamplingParams(**params))  # type: ignore[arg-type]


def forward_logprobs(model: torch.nn.Module, prompt: list[int], out: list[int]) -> list[float]:
    """Logprobs of `out` from one uncached forward pass over prompt + out, on the model's device."""
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out], device=device)).logits[0].float()
    scored = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return scored.gather(1, torch.tensor(out, device=device)[:, None])[:, 0].tolist()


def worst(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_engine_runs_on_the_device() -> None:
    # Guards the rest: a silent fall-back to the CPU would pass every other test here.
    assert torch.device(DEVICE).type == ("cuda" if DEVICE == "cuda" else DEVICE)


async def test_fp32_engine_equals_hf_generate_and_its_logprobs_a_fresh_forward(
    engine: LocalEngine, reference: torch.nn.Module,
) -> None:
    assert next(engine.model.parameters()).device.type == torch.device(DEVICE).type
    prompt = chat(engine, "Name three fruits.")
    eos = engine.tokenizer.eos_token_id
    out = await engine.generate(request(prompt, max_new_tokens=20, temperature=0,
                                        stop_token_ids=(eos,)))
    # An explicit mask: when a model's pad id differs from its eos id, `generate` guesses one
    # that hides every pad-id token in the prompt (on the H100, transformers 5.17 had converted
    # SmolLM2 with eos <|im_start|>, so the prompt's <|im_end|> tokens were hidden).
    ids = torch.tensor([prompt], device=engine.device)
    with torch.no_grad():
        hf = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                                do_sample=False, eos_token_id=eos)
    assert out.output_ids == hf[0, len(prompt):].tolist()
    assert worst(out.logprobs, forward_logprobs(reference, prompt, out.output_ids)) \
        <= FP32_LOGPROB_BOUND


async def test_seeded_sampling_on_the_device_is_reproducible(
    engine: LocalEngine, reference: torch.nn.Module,
) -> None:
    prompt = chat(engine, "Write a short poem about rain.")
    params = {"max_new_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 11}
    a = await engine.generate(request(prompt, **params))
    b, _ = await asyncio.gather(engine.generate(request(prompt, **params)),
                                engine.generate(request(chat(engine, "Hi"), max_new_tokens=8)))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 16
    with torch.no_grad():  # logprobs at temperature 0.8, before top-p truncation
        device = engine.device
        logits = reference(torch.tensor([prompt + a.output_ids], device=device)).logits[0]
        scaled = torch.log_softmax(logits[len(prompt) - 1 : -1].float() / 0.8, -1)
        ref = scaled.gather(1, torch.tensor(a.output_ids, device=device)[:, None])[:, 0].tolist()
    assert worst(a.logprobs, ref) <= FP32_LOGPROB_BOUND


async def test_concurrent_requests_of_different_lengths_match_running_alone(
    engine: LocalEngine,
) -> None:
    prompts = [chat(engine, "Hi"), chat(engine, "Explain in one sentence why the sky is blue."),
               chat(engine, "List two colours"),
               chat(engine, "What is two plus two? Answer with a number and a short reason.")]
    lengths = [12, 6, 9, 4]
    alone = [await engine.generate(request(p, max_new_tokens=n, temperature=0))
             for p, n in zip(prompts, lengths, strict=True)]

    async def late(p: list[int], n: int, delay: float) -> GenerateOutput:
        await asyncio.sleep(delay)
        return await engine.generate(request(p, max_new_tokens=n, temperature=0))

    together = await asyncio.gather(*(late(p, n, d) for p, n, d in
                                      zip(prompts, lengths, [0.0, 0.0, 0.05, 0.1], strict=True)))
    assert [o.output_ids for o in together] == [o.output_ids for o in alone]
    for a, b in zip(together, alone, strict=True):
        assert worst(a.logprobs, b.logprobs) <= FP32_LOGPROB_BOUND


async def test_weight_update_mid_stream_versions_later_tokens(engine: LocalEngine) -> None:
    # the weights come from the CPU, as a trainer on another device would send them
    await check_mid_stream_update(
        engine, lambda: {k: v.cpu() for k, v in engine.model.state_dict().items()})


def signed_group(actor: Actor, model_dir: str) -> tuple[TrainBatch, torch.Tensor]:
    """The four-reply group of test_real_step, on-policy under `actor`, and its advantages."""
    batch = one_group(model_dir)
    batch = TrainBatch(**{**batch.__dict__, "behav_logprobs_B_T": actor.compute_logprobs(batch)})
    adv = compute_advantages(batch, actor.config)
    return adv.batch, adv.adv_B_T


def captured_step(actor: Actor, batch: TrainBatch, adv: torch.Tensor,
                  replay: TrainBatch | None = None
                  ) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """`update`, keeping the fp32 master gradients the optimizer step sees (on the CPU)."""
    grads: dict[str, torch.Tensor] = {}
    original = actor.optimizer.step

    def step(*args: object, **kwargs: object) -> None:
        grads.update({n: p.grad.float().cpu() for n, p in actor.model.named_parameters()
                      if p.grad is not None})
        original(*args, **kwargs)  # type: ignore[arg-type]

    actor.optimizer.step = step  # type: ignore[method-assign]
    return actor.update(batch, adv, replay=replay), grads


def cosine(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Cosine similarity of two gradients, flattened over every parameter."""
    x = torch.cat([a[k].flatten() for k in sorted(a)])
    y = torch.cat([b[k].flatten() for k in sorted(a)])
    return float(x @ y / (x.norm() * y.norm()))


def test_an_update_on_the_device_agrees_with_the_cpu_fp32_update(model_dir: str) -> None:
    cfg = TrainConfig(lr=1e-5, micro_batch_tokens=100)
    cpu = Actor(model_dir, replace(cfg, bf16=False), device="cpu")
    fp32 = Actor(model_dir, replace(cfg, bf16=False), device=DEVICE)
    bf16 = Actor(model_dir, replace(cfg, bf16=True), device=DEVICE)
    batch, adv = signed_group(cpu, model_dir)
    mask = batch.loss_mask_B_T
    ref_lp = cpu.compute_logprobs(batch)[mask]
    # bf16 decoder, fp32 head: 0.013 nats off fp32 on average on the CPU (actor's docstring)
    assert (fp32.compute_logprobs(batch)[mask] - ref_lp).abs().max() <= FP32_LOGPROB_BOUND
    assert (bf16.compute_logprobs(batch)[mask] - ref_lp).abs().mean() <= 0.05
    (m_cpu, g_cpu), (m_fp32, g_fp32), (m_bf16, g_bf16) = (
        captured_step(a, batch, adv) for a in (cpu, fp32, bf16))
    assert m_cpu["n_tokens"] == m_fp32["n_tokens"] == m_bf16["n_tokens"] == batch.num_trained_tokens
    assert m_fp32["grad_norm"] == pytest.approx(m_cpu["grad_norm"], rel=1e-3)
    assert cosine(g_cpu, g_fp32) > 0.9999
    # bf16 rounds every activation: the direction holds, the norm within a few percent
    assert m_bf16["grad_norm"] == pytest.approx(m_cpu["grad_norm"], rel=0.1)
    assert cosine(g_cpu, g_bf16) > 0.95
    for actor in (fp32, bf16):
        assert actor.step == actor.version == 1
        assert next(actor.model.parameters()).device.type == torch.device(DEVICE).type


@pytest.mark.parametrize("packing,share,question", [
    ("unpad", True, QUESTION), ("unpad", False, QUESTION), ("pad", True, QUESTION),
    ("unpad", True, LONG_QUESTION)], ids=["unpad", "unpad-unshared", "pad", "unpad-stems"])
def test_unpadded_and_shared_prefix_micro_batches_on_the_device_take_the_cpu_step(
    model_dir: str, packing: str, share: bool, question: int,
) -> None:
    # Agent rows (one system prompt, a question per group) with replayed rows in their
    # micro-batches: on the device, unpadded pieces lay out as rows inside SDPA, whose CUDA
    # kernels take no mask with grouped heads (train/attention.py); the reference is the CPU's
    # plain padded rows, every token of every row run. With long questions, each group's runs
    # once as a stem (a per-row mask) when the budget holds both groups.
    cfg = TrainConfig(lr=1e-5, bf16=False, micro_batch_tokens=140 if question == QUESTION else 400,
                      length_bucket=1, sft_replay_coef=0.5)
    cpu = Actor(model_dir, replace(cfg, packing="pad", share_prefix=False), device="cpu")
    dev = Actor(model_dir, replace(cfg, packing=packing, share_prefix=share), device=DEVICE)
    rows = agent_batch(cpu.model.config.vocab_size, groups=3, seed=4, question_len=question)
    batch, replay = rows.select(range(6)), rows.select([6, 7, 8])
    batch = TrainBatch(**{**batch.__dict__, "behav_logprobs_B_T": cpu.compute_logprobs(batch)})
    assert all((mb.prefix_len > 0) == share for mb in dev.micro_batches(batch.extended(replay)))
    assert any(mb.piece_stems is not None for mb in dev.micro_batches(batch.extended(replay))
               ) == (question == LONG_QUESTION)
    assert all(mb.piece_lengths is None for mb in cpu.micro_batches(batch))
    mask = batch.loss_mask_B_T
    assert (dev.compute_logprobs(batch).cpu()[mask] - cpu.compute_logprobs(batch)[mask]
            ).abs().max() <= FP32_LOGPROB_BOUND
    adv = compute_advantages(batch, cfg).adv_B_T
    (m_cpu, g_cpu), (m_dev, g_dev) = (captured_step(a, batch, adv, replay) for a in (cpu, dev))
    assert m_dev["n_tokens"] == m_cpu["n_tokens"] == batch.num_trained_tokens
    assert m_dev["loss"] == pytest.approx(m_cpu["loss"], rel=1e-3, abs=1e-4)
    assert m_dev["sft_replay_loss"] == pytest.approx(m_cpu["sft_replay_loss"], rel=1e-4)
    assert m_dev["grad_norm"] == pytest.approx(m_cpu["grad_norm"], rel=1e-3)
    assert cosine(g_cpu, g_dev) > 0.9999
    if share:  # the prefix ran once: fewer tokens than the CPU's full rows
        assert m_dev["forward_tokens"] < m_cpu["forward_tokens"]


async def test_a_device_actor_update_reaches_the_device_engine_and_moves_logprobs(
    model_dir: str,
) -> None:
    actor = Actor(model_dir, TrainConfig(lr=1e-5, micro_batch_tokens=100), device=DEVICE)
    engine = LocalEngine(model_dir, device=DEVICE, seed=0, max_context=CONTEXT)
    try:
        assert actor.bf16 == (engine.dtype == torch.bfloat16)
        batch, adv = signed_group(actor, model_dir)
        before_B_T = actor.compute_logprobs(batch)
        metrics = actor.update(batch, adv)
        assert metrics["ratio_mean"] == pytest.approx(1.0)
        assert await engine.update_weights(actor.state_dict_for_engine(), version=actor.version) \
            == actor.version == 1
        after_B_T = actor.compute_logprobs(batch)
        mask = batch.loss_mask_B_T.float()
        delta_B = ((after_B_T - before_B_T) * mask).sum(-1) / mask.sum(-1)
        assert (delta_B[[0, 2]] > 0).all() and (delta_B[[1, 3]] < 0).all(), delta_B
        # The engine now serves the new weights: its logprobs of a reply are the actor's.
        row = batch.input_ids_B_T[0, : int(batch.attention_mask_B_T[0].sum())].tolist()
        start = int(batch.loss_mask_B_T[0].nonzero()[0])
        out = await engine.generate(request(row[:start], max_new_tokens=8, temperature=0))
        assert set(out.versions) == {1}
        scored = TrainBatch(
            input_ids_B_T=torch.tensor([row[:start] + out.output_ids]),
            attention_mask_B_T=torch.ones(1, start + len(out.output_ids), dtype=torch.bool),
            loss_mask_B_T=torch.tensor([[False] * start + [True] * len(out.output_ids)]),
            behav_logprobs_B_T=torch.zeros(1, start + len(out.output_ids)),
            versions_B_T=torch.zeros(1, start + len(out.output_ids), dtype=torch.long),
            rewards_B=torch.zeros(1), episode_ids=("e",), group_ids=("g",))
        actor_lp = actor.compute_logprobs(scored)[scored.loss_mask_B_T].tolist()
        bound = BF16_LOGPROB_BOUND if engine.dtype == torch.bfloat16 else FP32_LOGPROB_BOUND
        assert worst(out.logprobs, actor_lp) <= bound
    finally:
        await engine.aclose()
