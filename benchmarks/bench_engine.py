"""LocalEngine throughput against plain transformers `generate`, same model, same process.

Run by hand:  python -m benchmarks engine [--model NAME] [--new-tokens 128] [--no-write]

Every request asks for exactly `--new-tokens` tokens (no stop ids, so the end-of-turn token does
not end it; `min_new_tokens` does the same for `generate`). Measured, with torch on 2 threads:
  - LocalEngine aggregate tokens/s at 1, 8 and 32 concurrent requests, and time to first token
    (p50), in the engine's default dtype (and in fp32 at 32);
  - transformers `generate`, one request at a time (bf16 and fp32) and one static batch of 32;
    each of these rows is the best of `--repeats` interleaved rounds (the machine is shared);
  - transformers' own continuous batching (`generate_batch`, paged cache) on the 32 requests;
  - the decode floor: weight bytes / memory bandwidth (a large tensor copy) is the least time a
    decode step can take when weights stream from memory.
Prints the section, and writes it with the command, machine, ISA and load through the harness's
results writer (benchmarks/results/engine.md and .jsonl).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from benchmarks import harness
from relayrl.engine.local import LocalEngine
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.types import GenerateRequest, SamplingParams

NAME = "engine"
SECTION = "## LocalEngine throughput"
DTYPES = (torch.bfloat16, torch.float32)
NOTES = """Notes (measured by hand on 2026-11-22, same machine):
- Where a decode step of the model's forward went (batch 32, bf16, one thread, ~77 ms/step): linear
  layers 47% (on prepacked oneDNN weights; plain `F.linear`, which appears to re-lay out its
  bf16 weight for AMX on every call, took 1.8x longer), attention (SDPA) 18%, sampling (fp32
  log_softmax + max over 49k logits) 6%, KV-cache writes 4%, the rest (RMSNorm casts, rotary,
  activations, Python) 25%. The step is ~5x the weight-traffic floor: at batch 32 the products
  are compute- and overhead-bound.
- Where a LeanDecoder step goes (measured by hand on 2026-11-24, bf16, one thread,
  torch.profiler on the step + sampling, 150 cache columns, load ~3): batch 1 ~40 ms, of which
  linear products 81% (prepacked oneDNN, ~12 GB/s of weights read: one core's practical rate;
  bf16 `torch.mv` reads no faster) and attention 4%; batch 32 ~98 ms, of which products 46%
  (oneDNN at M=32 reaches only ~8 GB/s-equivalent), attention 30% (SDPA reads 3.7 MB of keys
  and values per layer at 150 columns at ~8.6 GB/s: bound by that traffic), sampling 5%, cache
  writes 3%.
- The machine is shared: with 2 torch threads, any other busy process stalls OpenMP barriers
  (a batch-32 step went from 57 ms to 1.3 s), so rows are the best of interleaved rounds and the
  load average is printed. With 1 thread and interleaved A/B runs at load ~2: LocalEngine at 32
  concurrent 345 tok/s vs a static `generate` batch of 32 at 285 tok/s.
- transformers' continuous batching (`generate_batch`) runs on CPU but its paged-attention
  path is slower than a plain static batch here; LocalEngine keeps its own loop (slot KV cache,
  per-request generators, logprobs, stop strings, weight versions).
- fp32 decodes at 32 concurrent about half as fast as bf16 (AMX), hence `dtype="auto"` = bf16;
  at batch 1 the two are within noise of each other."""
TOPICS = [
    "a lighthouse",
    "the moon",
    "a lost cat",
    "rainy Tuesdays",
    "a robot chef",
    "old maps",
    "a mountain village",
    "the deep sea",
    "a broken clock",
    "winter birds",
    "a desert town",
    "paper boats",
    "a night train",
    "forest spirits",
    "a chess match",
    "city lights",
]


@dataclass(frozen=True)
class Row:
    """One measured configuration."""

    name: str
    concurrency: int
    tokens: int
    seconds: float
    ttft_p50_s: float | None = None

    @property
    def tok_s(self) -> float:
        """Aggregate tokens per second."""
        return self.tokens / self.seconds


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of varied length."""
    prompts = []
    for i in range(n):
        extra = " Make it vivid." * (i % 4)
        text = f"Write a story about {TOPICS[i % len(TOPICS)]}.{extra}"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(rendered, add_special_tokens=False))
    return prompts


async def engine_round(engine: LocalEngine, prompts: list[list[int]], new: int) -> Row:
    """All prompts at once; aggregate tokens/s and p50 time to first token."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, params)) for p in prompts))
    seconds = time.perf_counter() - start
    assert all(len(o.output_ids) == new for o in outs), "every request must produce `new` tokens"
    ttft = statistics.median(o.timings.first_token_s for o in outs)
    return Row("", len(prompts), sum(len(o.output_ids) for o in outs), seconds, ttft)


def label(kind: str, dtype: torch.dtype) -> str:
    """A row name such as "LocalEngine (bfloat16)"."""
    return f"{kind} ({str(dtype).removeprefix('torch.')})"


def engine_measure(engine: LocalEngine, prompts, new: int, c: int) -> Callable[[], Row]:
    """c concurrent requests through the engine (c = 1: 2 requests one after another)."""
    name = label("LocalEngine", engine.dtype)

    def measure() -> Row:
        if c > 1:
            r = asyncio.run(engine_round(engine, prompts[:c], new))
            return Row(name, c, r.tokens, r.seconds, r.ttft_p50_s)
        runs = [asyncio.run(engine_round(engine, [p], new)) for p in prompts[:2]]
        ttft = statistics.median(r.ttft_p50_s or 0.0 for r in runs)
        return Row(name, 1, sum(r.tokens for r in runs), sum(r.seconds for r in runs), ttft)

    asyncio.run(engine_round(engine, prompts[:2], 8))  # warm-up: first-call allocations
    return measure


def hf_single_measure(model, prompts, new: int) -> Callable[[], Row]:
    """transformers `generate`, greedy, one request at a time (2 requests)."""
    gen = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}

    def measure() -> Row:
        start = time.perf_counter()
        tokens = 0
        with torch.inference_mode():
            for p in prompts[:2]:
                tokens += model.generate(torch.tensor([p]), **gen).shape[1] - len(p)
        return Row(label("HF generate", model.dtype), 1, tokens, time.perf_counter() - start)

    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
    return measure


def hf_static_measure(model, tokenizer, prompts, new: int) -> Callable[[], Row]:
    """transformers `generate`, greedy, all prompts as one left-padded batch."""
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    gen = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}

    def measure() -> Row:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=pad, **gen)
        seconds = time.perf_counter() - start
        tokens = (out.shape[1] - width) * len(prompts)
        return Row(label("HF generate, static batch", model.dtype), len(prompts), tokens, seconds)

    return measure


def interleaved(measures: list[Callable[[], Row]], repeats: int, bar: Any) -> list[Row]:
    """Best of `repeats` interleaved rounds, each round running every measurement once."""
    def each(_name: str, _round: int) -> None:
        bar.update(1)

    best = harness.best_of_rounds({str(i): m for i, m in enumerate(measures)}, repeats,
                                  lambda row: row.seconds, each=each)
    return list(best.values())


def bench_hf_continuous(path: str, dtype: torch.dtype, prompts: list[list[int]], new: int,
                        bar: Any, num_blocks: int | None = None) -> Row:
    """transformers' built-in continuous batching (`generate_batch`, paged attention); its paged
    cache takes most of the free memory unless `num_blocks` bounds it."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    bar.set_postfix_str("generate_batch (transformers continuous batching)")
    config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks) if num_blocks else None
    start = time.perf_counter()
    outs = model.generate_batch(prompts, generation_config=config, progress_bar=False,
                                continuous_batching_config=cb)
    seconds = time.perf_counter() - start
    bar.update(1)
    tokens = sum(len(o.generated_tokens) for o in outs.values())
    label = f"HF generate_batch ({str(dtype).removeprefix('torch.')})"
    return Row(label, len(prompts), tokens, seconds)


def memory_bandwidth_gbs(mib: int = 512) -> float:
    """Copy bandwidth (bytes read + written per second) of a tensor larger than the caches."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def machine() -> str:
    """The harness's machine line (CPU, cores, ISA, torch) and torch's thread count."""
    return f"{harness.machine().describe()}, {torch.get_num_threads()} threads"


def render(rows: list[Row], baseline: Row, floor: str, meta: dict[str, str]) -> str:
    """The RESULTS.md section."""
    lines = [
        SECTION,
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Date: {meta['date']}; load average before/after: {meta['load']}",
        "",
        f"{meta['new']} new tokens per request, greedy, no stop tokens; best of {meta['repeats']} "
        "interleaved rounds per row (transformers' generate_batch: one run, last). Speed-up is "
        "against the fastest "
        f"one-at-a-time `generate` ({baseline.name}, {baseline.tok_s:.1f} tok/s).",
        "",
        "| what | concurrent | tokens | seconds | tokens/s | speed-up | TTFT p50 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ttft = f"{r.ttft_p50_s * 1000:.0f} ms" if r.ttft_p50_s is not None else ""
        lines.append(
            f"| {r.name} | {r.concurrency} | {r.tokens} | {r.seconds:.1f} | {r.tok_s:.1f} | "
            f"{r.tok_s / baseline.tok_s:.1f}× | {ttft} |"
        )
    lines += ["", floor, "", NOTES, ""]
    return "\n".join(lines)


def measure_all(path: str, tokenizer, prompts, levels, args) -> tuple:
    """Every row, then transformers' generate_batch, the weight bytes and the memory bandwidth."""
    engine = LocalEngine(path, max_batch_size=max(levels))
    engine32 = LocalEngine(path, dtype="float32", max_batch_size=max(levels))
    dtype = engine.dtype
    models = {dt: AutoModelForCausalLM.from_pretrained(path, dtype=dt).eval() for dt in DTYPES}
    n = args.new_tokens
    try:
        measures = [engine_measure(engine, prompts, n, c) for c in levels]
        measures.append(engine_measure(engine32, prompts, n, levels[-1]))
        measures += [hf_single_measure(models[dt], prompts, n) for dt in DTYPES]
        measures.append(hf_static_measure(models[dtype], tokenizer, prompts, n))
        with tqdm(total=len(measures) * args.repeats + 2, desc="bench_engine", unit="run") as bar:
            rows = interleaved(measures, args.repeats, bar)
            engine.close()
            engine32.close()
            # a smoke run bounds the paged cache: on a shared machine 90% of free memory is not ours
            cb = bench_hf_continuous(path, dtype, prompts, n, bar, 16 if args.smoke else None)
            bar.set_postfix_str("memory bandwidth")
            bandwidth = memory_bandwidth_gbs(64 if args.smoke else 512)
            bar.update(1)
    finally:
        engine.close()
        engine32.close()
    # Distinct storages: tied embeddings are one tensor.
    storages = {p.data_ptr(): p.numel() * p.element_size() for p in models[dtype].parameters()}
    return rows, cb, dtype, sum(storages.values()), bandwidth


def main(argv: list[str] | None = None) -> None:
    """Run every measurement and report."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="best of N runs per measurement")
    args = ap.parse_args(argv)
    levels: tuple[int, ...] = (1, 8, 32)
    if args.smoke:
        args.model, args.new_tokens, args.repeats, levels = harness.smoke_model(), 4, 1, (1, 2)
    run = harness.Run.start(NAME, args, argv)
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = make_prompts(tokenizer, max(levels))

    rows, cb, dtype, wbytes, bandwidth = measure_all(path, tokenizer, prompts, levels, args)
    singles = [r for r in rows if r.name.startswith("HF generate (")]

    baseline = max(singles, key=lambda r: r.tok_s)
    # A decode step reads every weight once; the copy's traffic rate bounds how fast that can be.
    floor_s = wbytes / (bandwidth * 1e9)
    floor = (
        f"Decode floor ({str(dtype).removeprefix('torch.')}): {wbytes / 1e6:.0f} MB of weights / "
        f"{bandwidth:.1f} GB/s (copy of a 512 MiB tensor, bytes read + written per second) = "
        f"{floor_s * 1000:.1f} ms per decode step: at most {1 / floor_s:.0f} tok/s for one "
        f"sequence, {32 / floor_s:.0f} tok/s for 32, if weight traffic were the only cost."
    )
    meta = {
        "command": run.command,
        "machine": machine(),
        "date": run.started,
        "load": run.load(),
        "new": str(args.new_tokens),
        "repeats": str(args.repeats),
    }
    text = render([*rows, cb], baseline, floor, meta)
    print(text)
    run.finish(text, {"rows": [{"name": r.name, "concurrent": r.concurrency, "tok_s": r.tok_s,
                                "ttft_p50_s": r.ttft_p50_s} for r in [*rows, cb]],
                      "floor_ms": floor_s * 1000})


if __name__ == "__main__":
    main()
