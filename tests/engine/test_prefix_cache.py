"""Prefix reuse: the cache's bookkeeping, and LocalEngine giving the same tokens with it as without."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
import torch

from relayrl.engine.local import LocalEngine
from relayrl.engine.prefix_cache import BLOCK, PrefixCache, block_hashes
from relayrl.types import GenerateOutput, GenerateRequest, SamplingParams

LAYERS, HEADS, DIM = 2, 1, 4


def kv(n: int, fill: float = 1.0) -> torch.Tensor:
    return torch.full((LAYERS, 2 * HEADS, n, DIM), fill)


def nbytes(n: int) -> int:
    return kv(n).numel() * 4


def test_lookup_takes_the_longest_shared_prefix_and_leaves_one_token_to_run() -> None:
    cache = PrefixCache(1 << 20)
    stored = list(range(100, 150))  # 3 full blocks and 2 tokens
    cache.store(stored, kv(50))
    entry, n = cache.lookup([*stored[:37], 7, 8, 9])  # shares 37 tokens: 2 blocks, then 5 more
    assert entry is not None and n == 37
    entry, n = cache.lookup(stored)  # the same tokens: all but the last
    assert n == 49
    assert cache.lookup([*stored[:BLOCK], 1])[1] == BLOCK
    assert cache.lookup([5, *stored])[0] is None  # a different first block: nothing
    assert cache.lookup(stored[:BLOCK])[0] is None  # a match under one block is not worth a pass
    assert cache.stats.hits == 3 and cache.stats.lookups == 5
    assert cache.peek([*stored[:37], 7])[1] == 37  # the same answer, not counted
    assert cache.stats.hits == 3 and cache.stats.lookups == 5


def test_a_hash_collision_shortens_a_match_and_never_reuses_other_tokens() -> None:
    cache = PrefixCache(1 << 20)
    cache.store(list(range(64)), kv(64))
    other = list(range(1000, 1064))
    # Pretend the other prompt's first two blocks hash like the stored ones'.
    for h in block_hashes(other, 2):
        cache._owner[h] = next(iter(cache._entries.values()))
    assert cache.lookup(other) == (None, 0)


def test_the_longer_of_two_nested_entries_is_kept() -> None:
    cache = PrefixCache(1 << 20)
    turn1 = list(range(40))
    turn2 = [*turn1, *range(500, 530)]
    cache.store(turn1, kv(40))
    cache.store(turn2, kv(70))
    assert len(cache) == 1 and cache.nbytes == nbytes(70)
    cache.store(turn1, kv(40))  # already inside turn2's entry
    assert len(cache) == 1
    assert cache.lookup([*turn2, 9])[1] == 70


def test_entries_are_evicted_least_recently_used_within_the_byte_budget() -> None:
    cache = PrefixCache(nbytes(32) * 3)
    prompts = [[i * 1000 + t for t in range(32)] for i in range(4)]
    for p in prompts[:3]:
        cache.store(p, kv(32))
    assert cache.lookup([*prompts[0], 1])[0] is not None  # 0 is now the most recently used
    cache.store(prompts[3], kv(32))  # evicts 1, the least recently used
    assert cache.nbytes <= cache.max_bytes and len(cache) == 3 and cache.stats.evicted == 1
    assert cache.lookup([*prompts[1], 1])[0] is None
    assert all(cache.lookup([*prompts[i], 1])[0] is not None for i in (0, 2, 3))
    cache.store(list(range(200)), kv(200))  # larger than the whole budget: not kept
    assert len(cache) == 3
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0 and cache.lookup([*prompts[0], 1])[0] is None


# ---- LocalEngine: the same tokens with reuse as without -----------------------------------


@pytest.fixture(scope="module")
def engines(model_dir: str) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    """fp32 engines with and without reuse (exactness needs fp32), one thread each."""
    torch.manual_seed(0)
    reuse = LocalEngine(model_dir, device="cpu", dtype="float32", max_context=512, num_threads=1,
                        seed=0)
    plain = LocalEngine(model_dir, device="cpu", dtype="float32", max_context=512, num_threads=1,
                        seed=0, prefix_cache_mb=0)
    yield reuse, plain
    reuse.close()
    plain.close()


async def settled(engine: LocalEngine) -> None:
    """Wait (bounded) until the engine thread has retired every row, storing what it keeps."""
    for _ in range(500):
        if engine.active == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine did not go idle")


def random_ids(rnd: random.Random, n: int) -> list[int]:
    """n random token ids (clear of the special ones)."""
    return [rnd.randrange(100, 40000) for _ in range(n)]


def req(ids: list[int], n: int = 10) -> GenerateRequest:
    return GenerateRequest(prompt_ids=ids, params=SamplingParams(max_new_tokens=n, temperature=0))


async def both(engines: tuple[LocalEngine, LocalEngine],
               prompts: list[list[int]]) -> tuple[list[GenerateOutput], list[GenerateOutput]]:
    reuse, plain = engines
    a = await asyncio.gather(*(reuse.generate(req(p)) for p in prompts))
    b = await asyncio.gather(*(plain.generate(req(p)) for p in prompts))
    await settled(reuse)
    return list(a), list(b)


def assert_same(a: list[GenerateOutput], b: list[GenerateOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


async def test_an_agents_next_turns_reuse_the_last_ones_kv_and_sample_the_same_tokens(
    engines: tuple[LocalEngine, LocalEngine],
) -> None:
    reuse, _ = engines
    rnd = random.Random(1)
    system = random_ids(rnd, 70)
    turn1 = [[*system, *random_ids(rnd, 5 + 9 * i)] for i in range(4)]
    a1, b1 = await both(engines, turn1)
    assert_same(a1, b1)
    before = reuse.prefix_stats
    assert before is not None and before.stored >= 4
    reused_before = before.reused_tokens
    # The next turn of each (its prompt, its reply, a tool result), plus a new episode that
    # shares only the system prompt and one that shares nothing, admitted together.
    turn2 = [[*p, *o.output_ids, *random_ids(rnd, 3 + i)]
             for i, (p, o) in enumerate(zip(turn1, b1, strict=True))]
    turn2 += [[*system, 11, 12, 13], random_ids(rnd, 40)]
    a2, b2 = await both(engines, turn2)
    assert_same(a2, b2)
    reused = reuse.prefix_stats.reused_tokens - reused_before  # type: ignore[union-attr]
    # every continuing turn reuses its whole last prompt and reply but the reply's last token
    least = sum(len(p) + len(o.output_ids) - 1 for p, o in zip(turn1, b1, strict=True))
    assert reused >= least + (len(system) // BLOCK) * BLOCK


async def test_requests_that_arrive_together_prefill_their_common_prompt_once(
    engines: tuple[LocalEngine, LocalEngine],
) -> None:
    # A GRPO group (4 episodes, one prompt) and two other questions after the same system
    # prompt, with nothing cached: what a weight update leaves each new batch of rollouts.
    reuse, _ = engines
    rnd = random.Random(4)
    system = random_ids(rnd, 70)
    question = [*system, *random_ids(rnd, 9)]
    others = [[*system, *random_ids(rnd, 5 + i)] for i in range(2)]
    prompts = [question] * 4 + others
    stats = reuse.prefix_stats
    assert stats is not None
    before = (stats.lookups, stats.prompt_tokens, stats.reused_tokens)
    a, b = await both(engines, prompts)
    assert_same(a, b)
    lookups, prompt_tokens, reused = (stats.lookups - before[0],
                                      stats.prompt_tokens - before[1],
                                      stats.reused_tokens - before[2])
    assert lookups == len(prompts) and prompt_tokens == sum(map(len, prompts))
    # Whatever the engine thread's timing, at most two requests prefill the system prompt (the
    # first to arrive may be admitted alone); the rest reuse it, and the group's whole prompt.
    assert reused >= 2 * (len(question) - 1) + (len(system) // BLOCK) * BLOCK


async def test_a_weight_update_clears_the_cache_and_later_tokens_follow_the_new_weights(
    engines: tuple[LocalEngine, LocalEngine],
) -> None:
    reuse, _ = engines
    rnd = random.Random(2)
    prompt = random_ids(rnd, 60)
    first, _ = await both(engines, [prompt])
    name = "model.layers.0.mlp.down_proj.weight"
    saved = reuse.model.state_dict()[name].clone()
    noise = torch.randn(saved.shape, generator=torch.Generator().manual_seed(0))
    try:
        await asyncio.gather(*(e.update_weights({name: saved + 0.05 * noise}) for e in engines))
        stats = reuse.prefix_stats
        assert stats is not None and stats.cleared >= 1
        reused = stats.reused_tokens
        follow = [*prompt, *first[0].output_ids, 42, 43]
        a, b = await both(engines, [follow])
        assert_same(a, b)  # computed afresh with the new weights, as the plain engine does
        assert stats.reused_tokens == reused
    finally:
        await asyncio.gather(*(e.update_weights({name: saved}) for e in engines))


async def test_a_sequence_that_lived_through_a_weight_update_is_not_kept(
    engines: tuple[LocalEngine, LocalEngine],
) -> None:
    reuse, _ = engines
    rnd = random.Random(3)
    prompt = random_ids(rnd, 40)
    name = "model.norm.weight"
    saved = reuse.model.state_dict()[name].clone()
    stats = reuse.prefix_stats
    assert stats is not None
    stored = stats.stored
    got: list[int] = []
    updated = False
    async for chunk in reuse.stream(req(prompt, n=30)):
        got += chunk.ids
        if len(got) >= 3 and not updated:
            await reuse.update_weights({name: saved})  # same values, a new epoch
            updated, stored = True, stats.stored
    assert updated and len(got) == 30
    await settled(reuse)
    assert stats.stored == stored  # its KV mixes two epochs: dropped, not stored
    await reuse.generate(req(prompt, n=3))
    await settled(reuse)
    assert stats.stored == stored + 1  # a sequence of one epoch is kept


@pytest.fixture(scope="module")
def long_engines(model_dir: str) -> Iterator[tuple[LocalEngine, LocalEngine]]:
    """fp32 engines for long prompts: one reuses prefixes and prefills 256 tokens per pass, the
    other prefills every prompt whole in one pass with no reuse."""
    reuse = LocalEngine(model_dir, device="cpu", dtype="float32", max_context=4096,
                        num_threads=1, seed=0, max_prefill_tokens=256)
    plain = LocalEngine(model_dir, device="cpu", dtype="float32", max_context=4096,
                        num_threads=1, seed=0, prefix_cache_mb=0, max_prefill_tokens=8192)
    yield reuse, plain
    reuse.close()
    plain.close()


async def test_a_long_shared_prefix_is_prefilled_once_across_sessions(
    long_engines: tuple[LocalEngine, LocalEngine],
) -> None:
    # A coding CLI's episodes: the same long system prompt and tools, then each session's own
    # task; the sessions arrive one after another (the cache, not the admission pass, joins them).
    reuse, plain = long_engines
    assert reuse.lean_prefill  # the chunked path is the one under test
    rnd = random.Random(7)
    system = random_ids(rnd, 1300)  # 5 chunks of 256 and a partial one
    sessions = [[*system, *random_ids(rnd, 20 + 7 * i)] for i in range(3)]
    stats = reuse.prefix_stats
    assert stats is not None
    got, want = [], []
    for prompt in sessions:
        before = stats.reused_tokens
        got.append(await reuse.generate(req(prompt, n=8)))
        want.append(await plain.generate(req(prompt, n=8)))
        await settled(reuse)
        reused = stats.reused_tokens - before
        if prompt is sessions[0]:
            assert reused == 0
        else:  # every later session reuses the whole shared prefix (to its last full block)
            assert reused >= (len(system) // BLOCK) * BLOCK
    # chunked, reused prefill gives the tokens and logprobs of one whole fresh prefill
    assert_same(got, want)


async def test_decoding_sequences_keep_going_while_a_long_prompt_is_prefilled(
    long_engines: tuple[LocalEngine, LocalEngine],
) -> None:
    reuse, _ = long_engines
    rnd = random.Random(8)
    decoding = reuse.stream(req(random_ids(rnd, 30), n=400))
    first = await anext(decoding)
    assert first.ids
    long_prompt = random_ids(rnd, 3000)  # 12 chunks of 256 tokens
    long_task = asyncio.ensure_future(reuse.generate(req(long_prompt, n=1)))
    during = 0
    async for chunk in decoding:
        if long_task.done():
            break
        during += len(chunk.ids)
    await long_task
    await decoding.aclose()  # its remaining tokens check nothing more: abort them
    await settled(reuse)
    # one prefill pass would have stalled it for the whole prompt: no token in between
    assert during >= 5
