"""How many torch threads the trainer's update should use beside an in-process engine.

Run by hand:  RELAYRL_HOME=/tmp/rr python -m benchmarks update-threads [--no-write]

The trainer runs `Actor.update` (and SFT) in an `asyncio.to_thread` worker while the LocalEngine
samples the next batch on its own thread. Measured in one process, as the trainer runs them: a
LocalEngine on the default model (its default threads), and a real `Actor.update` of a batch like
the main job's (bench_train's synthetic rows) in a thread-pool worker with
  - "inherited": whatever count the worker was born with (what the trainer did before it set
    its threads: the engine thread's count leaks into threads started after it),
  - 1 or 2 threads, set in the worker (what `_in_threads` does now),
each with the engine idle (the SFT warm-start, an update that waits for no rollout) and with the
engine decoding `--streams` concurrent greedy requests the whole time (an RL step overlapping the
next batch's rollouts). With the engine busy, the engine's tokens/s during the update is the other
half of the trade. Conditions are interleaved, round after round; the median of `--repeats`
rounds after one warm-up round is reported. Prints the "## Trainer threads beside the engine"
section and writes it through the harness's results writer.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from benchmarks import harness
from benchmarks.bench_train import machine, synthetic_batch, update_fn
from relayrl.engine.local import LocalEngine
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig
from relayrl.types import GenerateRequest, SamplingParams

NAME = "update-threads"

SECTION = "## Trainer threads beside the engine"


@dataclass
class Sample:
    """One update: its wall time, and the engine tokens sampled while it ran."""

    update_s: float
    engine_tokens: int


class Load:
    """Keeps the engine decoding `streams` greedy requests until stopped; counts tokens."""

    def __init__(self, engine: LocalEngine, prompt: list[int], streams: int) -> None:
        self.engine, self.prompt, self.streams = engine, prompt, streams
        self.tokens = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _one(self) -> None:
        params = SamplingParams(max_new_tokens=64, temperature=0.0)
        for _ in range(100_000):  # bounded; stopped long before
            if self._stop.is_set():
                return
            request = GenerateRequest(prompt_ids=self.prompt, params=params)
            async for chunk in self.engine.stream(request):
                self.tokens += len(chunk.ids)

    def start(self) -> None:
        """Start the streams."""
        self._tasks = [asyncio.create_task(self._one()) for _ in range(self.streams)]

    async def stop(self) -> None:
        """Let each stream finish its request, then return."""
        self._stop.set()
        await asyncio.gather(*self._tasks)


def _set_and_run(threads: int | None, fn: Callable[[], object]) -> object:
    if threads is not None:
        torch.set_num_threads(threads)
    return fn()


async def in_new_thread(threads: int | None, fn: Callable[[], object]) -> None:
    """`fn` in a thread started now (as the trainer's pool workers were: after the engine's)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        await asyncio.get_running_loop().run_in_executor(pool, _set_and_run, threads, fn)


async def measure(engine: LocalEngine, update: Callable[[], object], prompt: list[int],
                  threads: int | None, busy: bool, streams: int) -> Sample:
    """One update in a worker thread, with the engine idle or decoding."""
    load = Load(engine, prompt, streams)
    if busy:
        load.start()
        await asyncio.sleep(1.0)  # let the batch fill
    before = load.tokens
    started = time.perf_counter()
    await in_new_thread(threads, update)
    seconds = time.perf_counter() - started
    tokens = load.tokens - before
    if busy:
        await load.stop()
    return Sample(seconds, tokens)


async def run(args: argparse.Namespace) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """Every condition, interleaved, `repeats` rounds after a warm-up round."""
    path = model_path(args.model)
    actor = Actor(path, TrainConfig(lr=1e-6, micro_batch_tokens=2048))
    engine = LocalEngine(path, seed=0)
    await asyncio.sleep(0.2)  # the engine thread has set its thread count
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        inherited = pool.submit(torch.get_num_threads).result()
    batch = synthetic_batch(args.rows, actor.model.config.vocab_size)
    update = update_fn(actor, batch, actor.config)
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        tokenize=False, add_generation_prompt=True)
    prompt = engine.tokenizer.encode(text, add_special_tokens=False)
    conditions = [(f"{busy_name}, {name}", threads, busy)
                  for busy_name, busy in (("engine idle", False), ("engine decoding", True))
                  for name, threads in (("inherited", None), ("1 thread", 1), ("2 threads", 2))]
    samples: dict[str, list[Sample]] = {c[0]: [] for c in conditions}
    meta = {"load_start": f"{harness.load_average():.2f}", "inherited": str(inherited),
            "engine_threads": str(engine.num_threads), "dtype": str(actor.model.dtype)}
    with tqdm(total=(args.repeats + 1) * len(conditions), desc="updates") as bar:
        for r, (name, threads, busy) in harness.rounds(conditions, args.repeats + 1):
            bar.set_postfix_str(f"{name}, round {r}")
            sample = await measure(engine, update, prompt, threads, busy, args.streams)
            if r > 0:
                samples[name].append(sample)
            bar.update(1)
    meta["load_end"] = f"{harness.load_average():.2f}"
    await engine.aclose()
    return samples, meta


def render(samples: dict[str, list[Sample]], meta: dict[str, str], args: argparse.Namespace,
           rows_tokens: int) -> str:
    """The RESULTS.md section."""
    lines = [
        SECTION, "",
        f"Command: `RELAYRL_HOME=/tmp/rr {meta['command']}` (commit {harness.commit()})  ",
        f"Machine: {machine()}; model weights {meta['dtype']}.  ",
        f"Date: {meta['date']}; load average (1 min) {meta['load_start']} at the start, "
        f"{meta['load_end']} at the end.",
        "",
        f"One real `Actor.update` of {args.rows} rows ({rows_tokens} tokens) in a thread-pool "
        f"worker beside a LocalEngine on {meta['engine_threads']} thread(s) in the same process; "
        f"a worker born after the engine thread started inherits {meta['inherited']} thread(s). "
        f"\"Engine decoding\": {args.streams} greedy streams of 64 tokens kept running through "
        f"the update. Median (min-max) of {args.repeats} interleaved rounds after a warm-up.",
        "",
        "| engine | update threads | update s | engine tok/s during the update |",
        "| --- | --- | ---: | ---: |",
    ]
    for name, runs in samples.items():
        engine_state, threads = name.split(", ")
        secs = [s.update_s for s in runs]
        rates = [s.engine_tokens / s.update_s for s in runs]
        rate = (f"{statistics.median(rates):.0f}" if engine_state == "engine decoding" else "-")
        lines.append(f"| {engine_state} | {threads} | {statistics.median(secs):.2f} "
                     f"({min(secs):.2f}-{max(secs):.2f}) | {rate} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Measure, print, and write the run unless --no-write."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.rows, args.streams, args.repeats = harness.smoke_model(), 2, 2, 1
    run_ = harness.Run.start(NAME, args, argv)
    samples, meta = asyncio.run(run(args))
    meta |= {"command": run_.command, "date": run_.started}
    path = model_path(args.model)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    text = render(samples, meta, args, int(synthetic_batch(args.rows, vocab).lengths_B.sum()))
    print(text)
    run_.finish(text, {name: [{"update_s": x.update_s, "engine_tokens": x.engine_tokens}
                              for x in xs] for name, xs in samples.items()})


if __name__ == "__main__":
    main()
