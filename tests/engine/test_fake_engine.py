"""FakeEngine: scripted replies through the real tokenizer, with the engine protocol's behaviour."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from tokenizers import Tokenizer

from relayrl.engine import InferenceEngine, load_engine
from relayrl.engine.fake import FakeEngine
from relayrl.errors import ConfigError, ContextLengthExceeded, EngineError, InvalidRequest
from relayrl.types import FinishReason, GenerateOutput, GenerateRequest, SamplingParams


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer.from_file(f"{model_dir}/tokenizer.json")


def request(ids: list[int] | None = None, **params) -> GenerateRequest:
    return GenerateRequest(prompt_ids=ids or [1, 2, 3], params=SamplingParams(**params))


async def test_replies_are_the_script_encoded_by_the_real_tokenizer_plus_end_of_turn(
    model_dir: str, tokenizer: Tokenizer
) -> None:
    engine = FakeEngine(["Hello there!", "Second reply."], tokenizer_path=model_dir)
    end = tokenizer.token_to_id("<|im_end|>")
    first = await engine.generate(request())
    second = await engine.generate(request())
    third = await engine.generate(request())
    assert engine.eos_token_id == end
    assert first.output_ids == [*tokenizer.encode("Hello there!").ids, end]
    assert tokenizer.decode(second.output_ids, skip_special_tokens=True) == "Second reply."
    assert third.output_ids == first.output_ids  # the script cycles
    assert first.finish_reason is FinishReason.STOP
    assert isinstance(engine, InferenceEngine)


async def test_a_callable_script_sees_each_request(model_dir: str) -> None:
    engine = FakeEngine(lambda r: f"you sent {len(r.prompt_ids)} tokens", tokenizer_path=model_dir)
    out = await engine.generate(request([5] * 7))
    assert engine.decode(out.output_ids).startswith("you sent 7 tokens")
    ids_script = FakeEngine(lambda r: [10, 11], tokenizer_path=model_dir, eos_token_id=12)
    assert (await ids_script.generate(request())).output_ids == [10, 11, 12]


async def test_default_script_answers_ok_without_a_tokenizer() -> None:
    engine = FakeEngine()
    out = await engine.generate(request())
    assert engine.decode(out.output_ids) == "ok"
    assert out.output_ids[-1] == engine.eos_token_id


async def test_max_new_tokens_cuts_the_reply_before_its_end_token(model_dir: str) -> None:
    engine = FakeEngine(["one two three four five six"], tokenizer_path=model_dir)
    out = await engine.generate(request(max_new_tokens=3))
    full = engine.encode("one two three four five six")
    assert out.output_ids == full[:3] and out.finish_reason is FinishReason.LENGTH


async def test_the_context_end_finishes_with_length(model_dir: str) -> None:
    engine = FakeEngine(["a b c d e f g"], tokenizer_path=model_dir, context_length=12)
    out = await engine.generate(request([1] * 10, max_new_tokens=50))
    assert len(out.output_ids) == 2 and out.finish_reason is FinishReason.LENGTH


async def test_stop_ids_and_stop_strings_end_the_reply(model_dir: str) -> None:
    engine = FakeEngine(["The answer is 42. Done."], tokenizer_path=model_dir)
    ids = engine.encode("The answer is 42. Done.")
    by_id = await engine.generate(request(stop_token_ids=(ids[2],)))
    by_text = await engine.generate(request(stop=("42",)))
    assert by_id.output_ids == ids[:3] and by_id.finish_reason is FinishReason.STOP
    assert by_text.stop_string == "42" and by_text.finish_reason is FinishReason.STOP
    assert "42" in engine.decode(by_text.output_ids)
    assert "42" not in engine.decode(by_text.output_ids[:-1])
    assert by_text.output_ids == ids[: len(by_text.output_ids)]


async def test_tokens_stream_one_by_one_with_versions_logprobs_and_timings(model_dir: str) -> None:
    engine = FakeEngine(["stream me please"], tokenizer_path=model_dir)
    chunks = [c async for c in engine.stream(request(top_logprobs=2))]
    assert all(len(c.ids) == 1 for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].timings is not None and chunks[-1].finish_reason is FinishReason.STOP
    assert all(lp < 0 for c in chunks for lp in c.logprobs)
    assert all(c.top_logprobs and c.top_logprobs[0][0].token_id == c.ids[0] for c in chunks)
    again = [c async for c in engine.stream(request())]
    assert [c.logprobs for c in again] == [c.logprobs for c in chunks]  # deterministic


@pytest.mark.parametrize("params", [
    {},
    {"max_new_tokens": 3},
    {"stop": ("there",)},
    {"stop_token_ids": (0,), "top_logprobs": 2},
    {"top_logprobs": 3, "max_new_tokens": 4},
])
async def test_a_whole_reply_equals_its_stream_joined(model_dir: str, tokenizer: Tokenizer,
                                                      params: dict) -> None:
    # generate builds the output in one piece (no chunks): it must be what streaming gives
    engine = FakeEngine(["Hello there, general Kenobi!"], tokenizer_path=model_dir)
    if params.get("stop_token_ids"):
        params = {**params, "stop_token_ids": (tokenizer.encode("general").ids[0],)}
    whole = await engine.generate(request(**params))
    joined = GenerateOutput.from_chunks([c async for c in engine.stream(request(**params))])
    assert whole.output_ids and whole.output_ids == joined.output_ids
    assert (whole.logprobs, whole.versions, whole.top_logprobs) == \
        (joined.logprobs, joined.versions, joined.top_logprobs)
    assert (whole.finish_reason, whole.stop_string) == (joined.finish_reason, joined.stop_string)


async def test_update_weights_bumps_the_version_of_later_tokens(model_dir: str) -> None:
    engine = FakeEngine(["a b c d e f"], tokenizer_path=model_dir)
    versions: list[int] = []
    async for chunk in engine.stream(request()):
        versions += chunk.versions
        if len(versions) == 2:
            assert await engine.update_weights({"anything": 1}) == 1
    assert versions[:2] == [0, 0] and set(versions[2:]) == {1}
    assert await engine.update_weights("/some/checkpoint", version=7) == 7
    assert engine.version == 7


async def test_token_delay_paces_the_stream(model_dir: str) -> None:
    engine = FakeEngine(["x y z"], tokenizer_path=model_dir, token_delay_s=0.02)
    out = await engine.generate(request())
    assert out.timings.total_s >= 0.02 * len(out.output_ids)


async def test_aclose_aborts_streams_in_flight(model_dir: str) -> None:
    # the close lands after the second token, whatever the machine's load (no wall-clock race)
    engine = FakeEngine(["a b c d e f g h"], tokenizer_path=model_dir, token_delay_s=0.01)
    chunks = []
    async for chunk in engine.stream(request()):
        chunks.append(chunk)
        if len(chunks) == 2:
            await engine.aclose()
    out = GenerateOutput.from_chunks(chunks)
    assert out.finish_reason is FinishReason.ABORT and 2 <= len(out.output_ids) < 9
    with pytest.raises(EngineError):
        engine.stream(request())


@pytest.mark.parametrize(
    ("ids", "params", "error"),
    [
        ([], {}, InvalidRequest),
        ([1] * 100, {}, ContextLengthExceeded),
        ([1], {"max_new_tokens": 0}, InvalidRequest),
        ([1], {"stop_token_ids": (10**7,)}, InvalidRequest),
    ],
)
def test_bad_requests_raise_when_the_stream_is_asked_for(
    model_dir: str, ids: list[int], params: dict, error: type[Exception]
) -> None:
    engine = FakeEngine(tokenizer_path=model_dir, context_length=100)
    with pytest.raises(error):
        engine.stream(GenerateRequest(prompt_ids=ids, params=SamplingParams(**params)))


def test_load_engine_builds_the_fake_and_refuses_unknown_kinds(model_dir: str) -> None:
    engine = load_engine("fake", model_dir, script=["hi"])
    assert isinstance(engine, FakeEngine) and engine.tokenizer is not None
    with pytest.raises(ConfigError):
        load_engine("nonexistent", model_dir)


def test_the_engine_package_imports_without_torch_or_transformers() -> None:
    code = (
        "import sys, relayrl.engine, relayrl.engine.fake;"
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


async def test_thousands_of_concurrent_requests_each_get_the_whole_reply(model_dir: str) -> None:
    # the gateway benchmarks drive the fake this hard; how fast it is lives in benchmarks/
    engine = FakeEngine(["The result is 42."], tokenizer_path=model_dir)
    one = await engine.generate(request())
    outs = await asyncio.gather(*(engine.generate(request()) for _ in range(2000)))
    assert one.output_ids and all(
        (o.output_ids, o.logprobs, o.finish_reason) == (one.output_ids, one.logprobs,
                                                        one.finish_reason) for o in outs)


@pytest.mark.parametrize(("prompt", "stops", "bad"), [
    ([1, 2, 99], [], None), ([1, -1, 2], [], -1), ([1, 100, 2], [], 100), ([5], [3, 100], 100),
    ([0], [0, 99], None)])
def test_token_ids_outside_the_vocabulary_are_named(prompt: list[int], stops: list[int],
                                                     bad: int | None) -> None:
    from relayrl.engine.base import validate_request

    request = GenerateRequest(prompt_ids=prompt,
                              params=SamplingParams(max_new_tokens=4, stop_token_ids=stops))
    if bad is None:
        validate_request(request, context_length=1000, vocab_size=100)
    else:
        with pytest.raises(InvalidRequest, match=f"token id {bad} is outside the vocabulary"):
            validate_request(request, context_length=1000, vocab_size=100)


def test_the_range_check_of_tokenizer_made_prompt_ids_is_skipped_but_not_of_stop_ids() -> None:
    from relayrl.engine.base import validate_request

    def request(stops: list[int]) -> GenerateRequest:
        return GenerateRequest(prompt_ids=[1, 100], tokenizer_ids=True,
                               params=SamplingParams(max_new_tokens=4, stop_token_ids=stops))

    validate_request(request([]), context_length=1000, vocab_size=100)  # trusted: not scanned
    with pytest.raises(InvalidRequest, match="token id 100 is outside the vocabulary"):
        validate_request(request([3, 100]), context_length=1000, vocab_size=100)


@pytest.mark.parametrize("budget", [1, 3, 5, 6, 20])
@pytest.mark.parametrize("stop_ids", [(), (9,), (4, 2), (7, 7)])
@pytest.mark.parametrize("reply", [[], [5], [1, 2, 3, 4, 5], [9, 1], [3, 7, 7, 9, 2]])
async def test_a_plan_without_stop_strings_is_the_token_by_token_plan(
        reply: list[int], stop_ids: tuple[int, ...], budget: int) -> None:
    # the one-pass plan (no stop strings) against the loop, which a stop string that never
    # matches forces: the same tokens, logprobs and finish
    engine = FakeEngine(lambda r: list(reply), vocab_size=64, eos_token_id=63,
                        context_length=10 + budget)
    fast = await engine.generate(request([1] * 10, max_new_tokens=budget,
                                         stop_token_ids=stop_ids))
    loop = await engine.generate(request([1] * 10, max_new_tokens=budget,
                                         stop_token_ids=stop_ids, stop=("never",)))
    assert (fast.output_ids, fast.logprobs, fast.finish_reason) == (
        loop.output_ids, loop.logprobs, loop.finish_reason)
    streamed = [c async for c in engine.stream(request([1] * 10, max_new_tokens=budget,
                                                       stop_token_ids=stop_ids))]
    joined = GenerateOutput.from_chunks(streamed)
    assert (joined.output_ids, joined.logprobs, joined.finish_reason) == (
        loop.output_ids, loop.logprobs, loop.finish_reason)
