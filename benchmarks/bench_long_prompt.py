"""LocalEngine on a coding CLI's long prompts: prefill time, decode stalls, prefix reuse across sessions.

Run by hand:  python benchmarks/bench_long_prompt.py [--model qwen2.5-coder-0.5b-instruct]
              [--part prefill itl sessions] [--tokens 4000 16000] [--session-tokens 16000]

Coding CLIs (Codex, Claude Code, Qwen Code, opencode) open every episode with a 9-25k-token
prompt: their system prompt and tool schemas, then the user's task. The prompt here has that
shape: a long system prompt of instructions and a list of JSON-schema tools rendered by the
model's own chat template, then one short user message per session (the text is generated,
the structure and lengths are a CLI's). Parts, each on one engine (the engine's own thread
count unless `--threads`; greedy; prefix cache off except in `sessions`):
  - prefill: time to first token of one prompt of each `--tokens` size, alone;
  - itl: a sequence decoding while a `--tokens[-1]`-token prompt arrives: its gaps between
    tokens before and during that prefill, and the long prompt's time to first token;
  - sessions: time to first token of the first call (cold), of a later session's call (same
    system prompt and tools, another task: the shared prefix comes from the prefix cache), of
    4 sessions' calls in flight together (prefix cached), and of 4 arriving together right
    after a weight update cleared the cache (one prefills the prefix, the others reuse it).
Prints a Markdown table with the command, the CPU, its ISA and the load average (the machine
may be shared: numbers are upper bounds; compare arms run in one session, interleaved).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from relayrl.engine.local import LocalEngine
from relayrl.models import model_path
from relayrl.types import GenerateRequest, SamplingParams

WORDS = [
    "file", "path", "edit", "read", "write", "tool", "call", "command", "shell", "test", "build",
    "run", "patch", "diff", "repository", "branch", "commit", "user", "task", "answer", "output",
    "error", "line", "function", "class", "module", "import", "search", "grep", "directory",
    "workspace", "permission", "sandbox", "approval", "review", "change", "plan", "step",
    "result", "check",
]


def isa() -> str:
    """The CPU's matrix and vector units that decide the engine's dtype and kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return "unknown ISA"
    have = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"),
                                    ("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags]
    return ", ".join(have) or "no AVX2"


def cpu() -> str:
    """CPU model and core count."""
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                    if "Model name" in line)
    except (OSError, subprocess.CalledProcessError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores, torch {torch.__version__}"


def sentence(rnd: random.Random, n: int) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(n)).capitalize() + "."


def cli_prefix(tokenizer, tokens: int) -> tuple[list[dict], list[dict]]:
    """A system prompt and tool list that render to about `tokens` tokens with a user turn."""
    rnd = random.Random(0)
    tools = []
    for i in range(24):
        props = {f"arg_{j}": {"type": rnd.choice(["string", "integer", "boolean"]),
                              "description": sentence(rnd, 12)} for j in range(5)}
        tools.append({"type": "function", "function": {
            "name": f"tool_{i}_{rnd.choice(WORDS)}", "description": sentence(rnd, 60),
            "parameters": {"type": "object", "properties": props, "required": ["arg_0"]}}})
    paragraphs: list[str] = []
    while True:
        system = "\n\n".join(paragraphs)
        n = len(render(tokenizer, system, tools[: max(1, min(24, tokens // 700))], "x"))
        if n >= tokens - 50:
            return [{"role": "system", "content": system}], tools[: max(1, min(24, tokens // 700))]
        paragraphs.append(f"## Rule {len(paragraphs) + 1}\n" + " ".join(
            sentence(rnd, 20) for _ in range(max(1, min(8, (tokens - n) // 30)))))


def render(tokenizer, system: str, tools: list[dict], user: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def prompts(tokenizer, tokens: int, sessions: int) -> list[list[int]]:
    """`sessions` prompts sharing a ~`tokens`-token CLI prefix, each with its own task."""
    system, tools = cli_prefix(tokenizer, tokens)
    return [render(tokenizer, system[0]["content"], tools,
                   f"Task {k}: in the repository, fix the failing test number {k * 37 % 101} "
                   f"and explain the change in one sentence.") for k in range(sessions)]


def request(ids: list[int], new: int) -> GenerateRequest:
    return GenerateRequest(prompt_ids=ids, params=SamplingParams(max_new_tokens=new,
                                                                 temperature=0))


async def ttft(engine: LocalEngine, ids: list[int], new: int = 4) -> float:
    """Seconds from submission to the first token."""
    start = time.perf_counter()
    async for _ in engine.stream(request(ids, new)):
        first = time.perf_counter() - start
        break
    return first


async def part_prefill(engine: LocalEngine, tok, sizes: list[int]) -> list[tuple[str, str]]:
    rows = []
    for n in sizes:
        ids = prompts(tok, n, 1)[0]
        t = await ttft(engine, ids)
        rows.append((f"prefill, {len(ids)}-token prompt, alone: time to first token",
                     f"{t:.1f} s ({len(ids) / t:.0f} prompt tokens/s)"))
    return rows


async def part_itl(engine: LocalEngine, tok, n: int) -> list[tuple[str, str]]:
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
    return [
        ("decoding sequence, gap between tokens before the long prompt (median)",
         f"{statistics.median(gaps_before) * 1e3:.0f} ms"),
        (f"the same while a {len(long_ids)}-token prompt is prefilled: longest gap / tokens "
         "emitted meanwhile", f"{max(during, default=t):.1f} s / {tokens_during}"),
        (f"that {len(long_ids)}-token prompt's time to first token", f"{t:.1f} s"),
    ]


async def part_sessions(engine: LocalEngine, tok, n: int) -> list[tuple[str, str]]:
    ids = prompts(tok, n, 10)
    first = await ttft(engine, ids[0])
    later = await ttft(engine, ids[1])
    group = await asyncio.gather(*(ttft(engine, p) for p in ids[2:6]))
    name = "model.norm.weight"
    await engine.update_weights({name: engine.model.state_dict()[name].clone()})  # clears the cache
    cold = await asyncio.gather(*(ttft(engine, p) for p in ids[6:10]))
    stats = engine.prefix_stats
    reuse = f"{stats.reused_tokens} of {stats.prompt_tokens}" if stats else "off"
    return [
        (f"first call, {len(ids[0])}-token prompt, nothing cached", f"{first:.1f} s"),
        ("a later session's first call (shared system prompt + tools cached)", f"{later:.2f} s"),
        ("4 sessions' calls in flight together, prefix cached: mean / slowest",
         f"{statistics.mean(group):.2f} s / {max(group):.2f} s"),
        ("4 sessions' calls together after a weight update (cache cleared): mean / slowest",
         f"{statistics.mean(cold):.1f} s / {max(cold):.1f} s"),
        ("prompt tokens reused from the prefix cache", reuse),
    ]


async def run(args: argparse.Namespace) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    path = model_path(args.model)
    for part in args.part:
        engine = LocalEngine(path, num_threads=args.threads, max_context=args.context,
                             max_prefill_tokens=args.chunk,
                             prefix_cache_mb=args.prefix_cache_mb if part == "sessions" else 0)
        tok = engine.tokenizer
        try:
            if part == "prefill":
                rows += await part_prefill(engine, tok, args.tokens)
            elif part == "itl":
                rows += await part_itl(engine, tok, args.tokens[-1])
            else:
                rows += await part_sessions(engine, tok, args.session_tokens)
        finally:
            await engine.aclose()
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    """Measure and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--part", nargs="+", default=["prefill", "itl", "sessions"],
                   choices=["prefill", "itl", "sessions"])
    p.add_argument("--tokens", type=int, nargs="+", default=[4000, 16000])
    p.add_argument("--session-tokens", type=int, default=16000)
    p.add_argument("--threads", type=int, default=None, help="engine threads (default: its own)")
    p.add_argument("--chunk", type=int, default=2048, help="LocalEngine max_prefill_tokens")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--prefix-cache-mb", type=int, default=512)
    args = p.parse_args()
    load = os.getloadavg()[0]
    started = time.perf_counter()
    rows = asyncio.run(run(args))
    print(f"Command: `python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}`  ")
    print(f"Machine: {cpu()}; ISA: {isa()}; load average {load:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after; {time.perf_counter() - started:.0f} s in all\n")
    print("| measurement | figure |\n| --- | --- |")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
