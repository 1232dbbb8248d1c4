"""Training throughput of `Actor.update`, and what segment packing (`concat` rows) saves.

Run by hand:  RELAYRL_HOME=/tmp/rr python -m benchmarks train [--no-write] [--no-packing]

Measured, with torch on 2 threads, on the default model:
  1. `Actor.update` (forward, backward, grad clip, AdamW step) on a batch shaped like the math
     agent's episodes: 16 rows of 394-472 random token ids, the loss on the last ~70 tokens in 3
     turns (30 + 30 + 10 tokens, 26 context tokens between turns, as in the main job's traces),
     behaviour logprobs -1, rewards 0/1 in groups of 4 (advantages +-0.87). In bf16
     (what `bf16="auto"` resolves to here) and in fp32. Model FLOPs = 6 x non-embedding params
     x forward tokens + 6 x lm-head params x trained tokens (the actor runs the head on trained
     positions only), divided by the time, against the peak of a large matmul in that dtype.
     The bf16 row runs the default path (a bf16 copy of the weights, lengths in buckets);
     `--compile` adds the default path with `train.compile=true` (its warm-up round compiles),
     in the same rounds.
  1b. Where an update goes, per path: forward alone (no grad), forward + backward, and grad
     clip + AdamW step (+ refreshing the bf16 copy), each the best of the same rounds.
  1c. Shared prefixes: 16 rows of the same lengths shaped like GRPO groups of agent episodes
     (every row starts with one 313-token system prompt with tool schemas, each group of 8
     with its own 20-token question, then a tool call, its result and an answer), updated with
     `share_prefix` off (each row runs its whole prompt) and on (a micro-batch runs its rows'
     common prefix once), and on with transformers' SDPA and the autograd head (what
     `relayrl.train.attention` and `relayrl.train.head` replaced), interleaved.
  2. The same 5-turn episodes exported both ways: `concat` (one row per episode, the model's
     own samples trained in place) and `individual` (one row per call, each repeating the whole
     prefix). Sessions are built as the gateway builds them (`Session.locate`, extended prompt,
     `new_interaction`, `record`), with a toy renderer that gives each message its own random
     token ids (one per character), so every call extends its parent's tokens. Reported:
     tokens in the rows, tokens the forward passes process (padding included), trained tokens,
     and the update time of each layout.
Every timing is the best of `--repeats` interleaved rounds after one warm-up (the machine is
shared). Prints the "## Training throughput" section and writes it through the harness's
results writer.
"""

from __future__ import annotations

import math
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch
from tqdm import tqdm

import relayrl.train.actor as actor_module
from benchmarks import harness
from relayrl.chat.conversation import Conversation, Message, ParsedReply, ToolCall
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train import attention
from relayrl.train.actor import Actor, resolve_bf16
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch
from relayrl.trajectory import Session, TrajectoryRow, export_session
from relayrl.types import FinishReason, GenerateOutput, Timings

NAME = "train"
SECTION = "## Training throughput"
GLUE = 26
"""Context tokens between two sampled turns (tool result + template), as in the main job."""
TURNS_1 = (30, 30, 10)
"""Part 1: sampled tokens per turn in a row (the main job's traces: 67 on average, 2-3 turns)."""
PROMPT = 333
"""Part 2: tokens of the first prompt (system with tool schemas + question), as in the traces."""
REPLIES = (35, 36, 36, 36, 12)
"""Part 2: sampled tokens per call of a 5-turn episode (4 tool calls, then the answer)."""
BOS, EOT, GEN = 1, 2, 3
ROLE = {"system": 4, "user": 5, "assistant": 6, "tool": 7}
NOTES = """Notes (measured by hand on 2026-11-24, same machine, shared: load 1.5-6, so only ratios
within one run are compared):
- Where one bf16 micro-batch's forward + backward goes (8 rows x 465 tokens, torch.profiler, self
  CPU time): autocast 6.4 s = matmuls 1.9, flash-attention backward 1.15 and forward 0.39,
  elementwise mul 0.83, dtype casts (copy_) 0.82, adds 0.37, the rest 0.9; the bf16 copy 5.0 s =
  matmuls 1.75, attention 1.15 + 0.32, mul 0.60, casts 0.24, adds 0.29. The body's matmuls run at
  about 55% of the bf16 matmul peak; what keeps the update far below it is attention (the CPU
  flash kernel's backward runs at ~130 GFLOP/s) and memory-bound elementwise ops on 2 cores.
  Explicit bf16 matmul attention and the math SDPA backend were 2.8x and 3.6x slower than flash.
- The optimizer: over SmolLM2's 135M fp32 parameters, AdamW default (per-tensor loop) 4.5 s,
  foreach 4.2 s, fused 1.0 s; clip_grad_norm_ 0.36 s; refreshing the bf16 copy 0.30 s (one run,
  best of 3, interleaved; load 2.6-5.8).
- Precision (SmolLM2, 2 rows, 140 trained tokens, mean / max |logprob - fp32 logprob|): autocast
  0.021 / 0.136 nats, bf16 copy 0.038 / 0.147, bf16 copy compiled 0.032 / 0.124. Gradients of
  one on-policy update (4 rows), relative L2 distance from fp32's: autocast 3.0%, copy 4.5%.
- `train.compile` (decoder layers compiled, dynamic shapes): ~55 s to compile on 2 cores at
  load ~6; one micro-batch's forward + backward then 17.4 s vs 32.4 s eager in the same run."""


# -- part 1: a batch like the math agent's -------------------------------------------------------


def synthetic_row(i: int, length: int, vocab: int, rng: random.Random) -> TrajectoryRow:
    """A row of `length` random ids, trained on the last turns of `TURNS_1` with glue between."""
    n_turns = len(TURNS_1)
    start = length - sum(TURNS_1) - GLUE * (n_turns - 1)
    mask, spans = [0] * length, []
    for k, n in enumerate(TURNS_1):
        spans.append((start, start + n))
        mask[start : start + n] = [1] * n
        start += n + (GLUE if k < n_turns - 1 else 0)
    return TrajectoryRow(
        session_id=f"ep{i}",
        task_id=f"task{i // 4}",
        segment_id=f"seg{i}",
        style="concat",
        interaction_ids=[f"c{i}-{k}" for k in range(n_turns)],
        input_ids=[rng.randrange(vocab) for _ in range(length)],
        loss_mask=mask,
        logprobs=[-1.0 * m for m in mask],
        versions=[0 if m else -1 for m in mask],
        reward=float(i % 2),  # groups of 4 with rewards 0, 1, 0, 1: advantages -1, +1
        turn_spans=spans,
        turn_rewards=[float(i % 2)] * n_turns,
    )


SYSTEM, QUESTION, GROUP, CALL = 313, 20, 8, 35
"""Part 1c: a shared system prompt, a question per group (333 prompt tokens, as `PROMPT`), rows
per group, and the sampled tokens of an episode's first call (a tool call)."""


def agent_batch(rows: int, vocab: int, seed: int = 0) -> TrainBatch:
    """Rows of 399-472 tokens: the shared system prompt, the group's question, a tool call, a
    tool result (`GLUE` tokens) and an answer of the rest; the two replies are trained."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab) for _ in range(SYSTEM)]
    out = []
    for i in range(rows):
        if i % GROUP == 0:
            question = [rng.randrange(vocab) for _ in range(QUESTION)]
        length = rng.randint(399, 472)
        answer = length - SYSTEM - QUESTION - CALL - GLUE
        mask = [0] * (SYSTEM + QUESTION) + [1] * CALL + [0] * GLUE + [1] * answer
        start = SYSTEM + QUESTION
        out.append(TrajectoryRow(
            session_id=f"ep{i}", task_id=f"task{i // GROUP}", segment_id=f"seg{i}",
            style="concat", interaction_ids=[f"c{i}-0", f"c{i}-1"],
            input_ids=system + question + [rng.randrange(vocab) for _ in range(length - start)],
            loss_mask=mask, logprobs=[-1.0 * m for m in mask],
            versions=[0 if m else -1 for m in mask], reward=float(i % 2),
            turn_spans=[(start, start + CALL), (start + CALL + GLUE, length)],
            turn_rewards=[float(i % 2)] * 2,
        ))
    return TrainBatch.from_rows(out)


def synthetic_batch(rows: int, vocab: int, seed: int = 0) -> TrainBatch:
    """`rows` rows of 394-472 tokens (the range of the main job's episodes)."""
    rng = random.Random(seed)
    return TrainBatch.from_rows([synthetic_row(i, rng.randint(394, 472), vocab, rng)
                                 for i in range(rows)])


# -- part 2: 5-turn sessions, exported both ways --------------------------------------------------


def render_message(m: Message, vocab: int) -> tuple[int, ...]:
    """Toy rendering: BOS role ids EOT, one random id per character, fixed by the message."""
    rng = random.Random(f"{m.role}|{m.content}")
    return (BOS, ROLE[m.role], *(rng.randrange(8, vocab) for _ in m.content), EOT)


def text(rng: random.Random, tokens: int) -> str:
    """A random text that renders to `tokens` ids in a message (3 are BOS, role, EOT)."""
    return "".join(rng.choices(string.ascii_letters, k=tokens - 3))


def record_call(session: Session, messages: list[Message], n_out: int, tool: ToolCall | None,
                vocab: int, rng: random.Random) -> None:
    """What the gateway does for one call: locate, render or extend, generate, record."""
    conv = Conversation(tuple(messages))
    located = session.locate(conv)
    if located.reason is None and located.parent is not None:
        body = [t for m in located.new_messages for t in render_message(m, vocab)]
        prompt = (*located.parent.token_ids, *body, BOS, GEN)
    else:
        prompt = (*(t for m in messages for t in render_message(m, vocab)), BOS, GEN)
    ids = [rng.randrange(8, vocab) for _ in range(n_out - 1)] + [EOT]
    output = GenerateOutput(output_ids=ids, logprobs=[-1.0] * n_out, versions=[0] * n_out,
                            finish_reason=FinishReason.STOP, timings=Timings())
    reply = ParsedReply("" if tool else "answer", tool_calls=(tool,) if tool else ())
    session.record(session.new_interaction(conversation=conv, reply=reply, prompt_ids=prompt,
                                           output=output, parent=located.parent,
                                           reason=located.reason))


def five_turn_session(i: int, vocab: int, rng: random.Random) -> Session:
    """An agent episode: question, 4 tool calls and results, an answer; reward 0 or 1."""
    session = Session(f"ep{i}", task_id=f"task{i // 4}")
    history = [Message("system", text(rng, PROMPT - 40 - 2)), Message("user", text(rng, 40))]
    for k, n_out in enumerate(REPLIES):
        last = k == len(REPLIES) - 1
        tool = None if last else ToolCall(f"call_{k}", "add", '{"a": 1, "b": 2}')
        record_call(session, history, n_out, tool, vocab, rng)
        if not last:
            # the tool message plus the next generation prompt (2 ids) make GLUE tokens
            history += [Message("assistant", "", tool_calls=(tool,)),
                        Message("tool", text(rng, GLUE - 2), tool_call_id=tool.id)]
    session.set_final_reward(float(i % 2))
    session.end()
    return session


def episode_batches(episodes: int, vocab: int, seed: int = 1) -> dict[str, TrainBatch]:
    """The same episodes as `concat` and `individual` batches."""
    rng = random.Random(seed)
    sessions = [five_turn_session(i, vocab, rng) for i in range(episodes)]
    return {style: TrainBatch.from_rows([r for s in sessions for r in export_session(s, style)])
            for style in ("concat", "individual")}


# -- measuring ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """The best of several updates of one batch under one actor."""

    name: str
    rows: int
    real_tokens: int
    """Sum of row lengths."""
    forward_tokens: int
    """Tokens the forward passes process (padding included)."""
    trained_tokens: int
    seconds: float
    flops: float

    @property
    def tok_s(self) -> float:
        """Real tokens per second."""
        return self.real_tokens / self.seconds


def update_fn(actor: Actor, batch: TrainBatch, cfg: TrainConfig) -> Callable[[], dict[str, float]]:
    """One real `Actor.update` of the batch with its group advantages."""
    adv = compute_advantages(batch, cfg)
    return lambda: actor.update(adv.batch, adv.adv_B_T)


def breakdown_fns(actor: Actor, batch: TrainBatch, cfg: TrainConfig) -> dict[str, Callable[[], float]]:
    """Timers of the parts of one update: forward alone, forward + backward, optimizer step."""
    adv = compute_advantages(batch, cfg)
    b = adv.batch

    def timed(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def fwd_bwd() -> None:
        actor.optimizer.zero_grad(set_to_none=True)
        for mb in actor.micro_batches(b):
            actor.backward(actor.token_logprobs(actor.model, mb).sum() * 1e-3)

    def opt() -> None:
        params = [p for p in actor.model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        actor.apply_gradients(1e-12)  # a real step, too small to move the weights measurably

    # opt needs the gradients fwd_bwd leaves, so the order of the dict is the order to run
    return {"forward": lambda: timed(lambda: actor.compute_logprobs(b)),
            "forward + backward": lambda: timed(fwd_bwd),
            "clip + AdamW step": lambda: timed(opt)}


def autograd_head(hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor,
                  targets_N: torch.Tensor, low_V_H: torch.Tensor | None = None) -> torch.Tensor:
    """The actor's head before `relayrl.train.head`: fp32 logits through autograd's logsumexp
    (`low_V_H`, the bf16 twin the actor offers, is not used)."""
    logits_N_V = hidden_N_H.float() @ weight_V_H.t()
    return logits_N_V.gather(-1, targets_N[:, None])[:, 0] - logits_N_V.logsumexp(-1)


def former_kernels(path: str, cfg: TrainConfig,
                   ) -> Callable[[TrainBatch], Callable[[], dict[str, float]]]:
    """An actor with transformers' SDPA (which copies each key/value head per query head under
    a mask) and `autograd_head`; returns its update-fn maker."""
    with mock.patch.object(attention, "resolve", lambda impl: impl):
        actor = Actor(path, cfg)

    def make(batch: TrainBatch) -> Callable[[], dict[str, float]]:
        fn = update_fn(actor, batch, cfg)

        def run() -> dict[str, float]:
            with mock.patch.object(actor_module, "head_logprobs", autograd_head):
                return fn()
        return run
    return make


def interleaved(fns: dict[str, Callable[[], dict[str, float]]], repeats: int,
                bar: tqdm) -> dict[str, tuple[float, dict[str, float]]]:
    """Best update time of each function over `repeats` interleaved rounds, after a warm-up."""
    def each(name: str, r: int) -> None:
        bar.set_postfix_str(f"{name}, round {r}")
        bar.update(1)

    best = harness.best_of_rounds(fns, repeats, lambda m: m["update_s"], warmup=1, each=each)
    return {name: (m["update_s"], m) for name, m in best.items()}


def result(name: str, batch: TrainBatch, seconds: float, metrics: dict[str, float],
           body_params: int, head_params: int) -> Result:
    """A row of the table: token counts and model FLOPs of one update."""
    forward, trained = int(metrics["forward_tokens"]), int(metrics["n_tokens"])
    flops = 6.0 * body_params * forward + 6.0 * head_params * trained
    return Result(name, batch.num_rows, int(batch.lengths_B.sum()), forward, trained, seconds,
                  flops)


def param_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(non-embedding params, lm-head params); a tied head counts once, as the head."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    body = sum(unique.values()) - emb.numel() - (0 if head.data_ptr() == emb.data_ptr()
                                                 else head.numel())
    return body, head.numel()


def matmul_peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """Best GFLOP/s of an n x n x n matmul in `dtype` (2 n^3 flops)."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: oneDNN picks and caches its kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def machine() -> str:
    """The harness's machine line (CPU, cores, ISA, torch) and torch's thread count."""
    return f"{harness.machine().describe()}, {torch.get_num_threads()} threads"


def peak_of(name: str, peaks: dict[str, float]) -> float:
    """The matmul peak of a row's dtype (its name starts with it)."""
    return peaks[name.split()[0]]


def throughput_table(rows: list[Result], peaks: dict[str, float]) -> list[str]:
    """Part 1's table."""
    lines = ["| precision | rows | tokens | forward tokens | trained | update s | tokens/s | "
             "model GFLOP/s | matmul peak GFLOP/s | share of peak |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gflops = r.flops / r.seconds / 1e9
        peak = peak_of(r.name, peaks)
        lines.append(f"| {r.name} | {r.rows} | {r.real_tokens} | {r.forward_tokens} | "
                     f"{r.trained_tokens} | {r.seconds:.2f} | {r.tok_s:.0f} | {gflops:.0f} | "
                     f"{peak:.0f} | {gflops / peak:.0%} |")
    return lines


def breakdown_table(parts: dict[str, dict[str, float]]) -> list[str]:
    """Part 1b's table: seconds per part of an update, per path."""
    lines = ["| path | forward s | forward + backward s | (forward + backward) / forward | "
             "clip + AdamW step s |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, t in parts.items():
        fwd, both = t["forward"], t["forward + backward"]
        lines.append(f"| {name} | {fwd:.2f} | {both:.2f} | {both / fwd:.1f} | "
                     f"{t['clip + AdamW step']:.2f} |")
    return lines


def packing_table(concat: Result, indiv: Result) -> list[str]:
    """Part 2's table and ratios."""
    lines = ["| layout | rows | tokens in rows | forward tokens (padded) | trained tokens | "
             "update s | trained tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in (indiv, concat):
        lines.append(f"| {r.name} | {r.rows} | {r.real_tokens} | {r.forward_tokens} | "
                     f"{r.trained_tokens} | {r.seconds:.2f} | "
                     f"{r.trained_tokens / r.seconds:.1f} |")
    lines += [
        "",
        f"individual / concat: {indiv.real_tokens / concat.real_tokens:.2f}x the tokens in rows, "
        f"{indiv.forward_tokens / concat.forward_tokens:.2f}x the forward tokens, "
        f"{indiv.trained_tokens / concat.trained_tokens:.2f}x the trained tokens, "
        f"{indiv.seconds / concat.seconds:.2f}x the update time.",
    ]
    return lines


def render(meta: dict[str, str], part1: list[Result], peaks: dict[str, float],
           params: tuple[int, int], parts: dict[str, dict[str, float]],
           shared: list[Result], packing: tuple[Result, Result] | None) -> str:
    """The RESULTS.md section."""
    body, head = params
    lines = [
        SECTION,
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Date: {meta['date']}; load average (1 min) before/after: {meta['load']}",
        "",
        f"What is measured: `Actor.update` on the default model ({meta['model']}), default "
        f"`TrainConfig` (micro_batch_tokens {meta['mbt']}, packing `pad`, length buckets of "
        f"{meta['bucket']}, grad clip, AdamW on fp32 master weights, fp32 lm head): forward, "
        f"backward and optimizer step, best of {meta['repeats']} interleaved rounds after a "
        f"warm-up. `bf16=\"auto\"` resolves to {meta['auto']} on this CPU. `bf16` is the "
        "default path (forward and backward on a bf16 copy of the weights, fused AdamW).",
        "",
        "### Update throughput",
        "",
        f"{part1[0].rows} rows of 394-472 random token ids (the range of the main job's math "
        "agent episodes), loss on the last 70 tokens in 3 turns (30 + 30 + 10, 26 context "
        "tokens between), behaviour logprobs -1, rewards 0/1 in groups of 4 (group advantages "
        "+-0.87). tokens/s counts the rows' real tokens; forward tokens include padding. "
        "Model FLOPs = 6 x "
        f"{body / 1e6:.1f}M non-embedding params x forward tokens + 6 x {head / 1e6:.1f}M "
        "lm-head params (tied with the embedding) x trained tokens (the actor runs the head on "
        "trained positions only); attention scores are not counted. Peak: best of 10 "
        "2048x2048x2048 matmuls in the same dtype.",
        "",
        *throughput_table(part1, peaks),
        "",
        "### Where an update goes",
        "",
        "The same batch, per bf16 path, best of the same rounds: forward alone (no grad, "
        "`compute_logprobs`), forward + backward of every micro-batch, and grad clip + AdamW "
        "step (for the copy, refreshing it from the fp32 masters too).",
        "",
        *breakdown_table(parts),
    ]
    if shared:
        off, kernels, on = shared
        lines += [
            "",
            "### Shared prefixes: agent episodes of GRPO groups",
            "",
            f"{on.rows} rows of 399-472 tokens shaped like the main job's episodes: one "
            f"{SYSTEM}-token system prompt (tool schemas) for every row, a {QUESTION}-token "
            f"question per group of {GROUP}, then a {CALL}-token tool call, {GLUE} tokens of tool "
            "result and template, and an answer of the rest (the two replies trained; rewards "
            "0/1 alternating). "
            "bf16 update with `share_prefix` off (every row runs its whole prompt) and on (the "
            "default: a micro-batch's rows run their common prefix once), and on with "
            "transformers' SDPA and the autograd head (`former kernels`), on the same rows, "
            "interleaved. Model FLOPs "
            "count the forward tokens each path actually runs.",
            "",
            *throughput_table(shared, peaks),
            "",
            f"on / off: {off.forward_tokens / on.forward_tokens:.2f}x fewer forward tokens, "
            f"{off.seconds / on.seconds:.2f}x faster update; on / the same with the former "
            "kernels (transformers' SDPA copying each key/value head per query head under the "
            "prefix's mask, and the head's logprobs through autograd's logsumexp, as before "
            f"`relayrl.train.attention` and `relayrl.train.head`): "
            f"{kernels.seconds / on.seconds:.2f}x faster update.",
        ]
    if packing is not None:
        concat, indiv = packing
        lines += [
            "",
            "### Segment packing: concat vs individual rows",
            "",
            f"{meta['episodes']} agent episodes of 5 calls (a {PROMPT}-token first prompt, "
            f"replies of {' + '.join(map(str, REPLIES))} tokens, {GLUE} tokens of tool result "
            "and template between calls), recorded as the gateway records them "
            "(`Session.locate`, extended prompts, `record`) and exported with `export_session` "
            "in both styles; bf16 `Actor.update` on each.",
            "",
            *packing_table(concat, indiv),
        ]
    lines += ["", NOTES]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the measurements and report."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=16, help="rows of the throughput batch")
    ap.add_argument("--episodes", type=int, default=8, help="5-turn episodes for the packing run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="best of N rounds per measurement")
    ap.add_argument("--no-fp32", action="store_true", help="skip the fp32 row")
    ap.add_argument("--compile", action="store_true",
                    help="add a `bf16 compiled` row (train.compile=true; compiled in the warm-up)")
    ap.add_argument("--no-packing", action="store_true", help="skip the concat/individual run")
    ap.add_argument("--no-shared", action="store_true", help="skip the shared-prefix run")
    args = ap.parse_args(argv)
    peak_n = 2048
    if args.smoke:
        args.model, args.rows, args.episodes, args.repeats, peak_n = (
            harness.smoke_model(), 2, 2, 1, 256)  # 2 rows: one group, a shared prefix
    run = harness.Run.start(NAME, args, argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = TrainConfig()
    path = model_path(args.model)
    configs = {"bf16": cfg}
    if args.compile:
        configs["bf16 compiled"] = TrainConfig(compile=True)
    if not args.no_fp32:
        configs["fp32"] = TrainConfig(bf16=False)
    actors = {name: Actor(path, c) for name, c in configs.items()}
    if not actors["bf16"].bf16:
        print("warning: bf16='auto' resolved to fp32 on this CPU; the bf16 rows are fp32 too")
    vocab = actors["bf16"].model.config.vocab_size
    params = param_counts(actors["bf16"].model)
    batch = synthetic_batch(args.rows, vocab)
    episodes = episode_batches(args.episodes, vocab)
    rounds = args.repeats + 1
    total = 2 + rounds * (len(actors) + 6 + (0 if args.no_packing else 2)
                          + (0 if args.no_shared else 3))
    with tqdm(total=total, desc="bench_train", unit="step") as bar:
        bar.set_postfix_str("matmul peaks")
        fp32_peak = matmul_peak_gflops(torch.float32, peak_n)
        # Without bf16 units the "bf16" rows run fp32, and a bf16 matmul is emulated (2048^3 took
        # minutes on a Zen 3 core): the fp32 peak is theirs.
        peaks = {"bf16": matmul_peak_gflops(torch.bfloat16, peak_n) if actors["bf16"].bf16 else fp32_peak,
                 "fp32": fp32_peak}
        bar.update(2)
        best = interleaved({name: update_fn(a, batch, configs[name]) for name, a in actors.items()},
                           args.repeats, bar)
        part1 = [result(name, batch, *best[name], *params) for name in actors]
        for name in ("fp32", "bf16 compiled"):  # free their weights before the rest
            actors.pop(name, None)
        parts: dict[str, dict[str, float]] = {name: {} for name in actors}
        timers = {name: breakdown_fns(a, batch, configs[name]) for name, a in actors.items()}
        for r in range(rounds):  # bounded: repeats + 1 rounds, the first a warm-up
            for name, fns in timers.items():
                for part, fn in fns.items():
                    bar.set_postfix_str(f"{name} {part}, round {r}")
                    seconds = fn()
                    if r > 0:
                        parts[name][part] = min(parts[name].get(part, math.inf), seconds)
                    bar.update(1)
        shared: list[Result] = []
        if not args.no_shared:
            agents = agent_batch(args.rows, vocab)
            unshared_cfg = TrainConfig(share_prefix=False, packing="pad")
            unshared = Actor(path, unshared_cfg)
            former = former_kernels(path, TrainConfig(packing="pad"))
            arms = {"bf16 share_prefix off": update_fn(unshared, agents, unshared_cfg),
                    "bf16 share_prefix on, former kernels": former(agents),
                    "bf16 share_prefix on": update_fn(actors["bf16"], agents, cfg)}
            best = interleaved(arms, args.repeats, bar)
            del unshared, former
            shared = [result(k, agents, *best[k], *params) for k in arms]
        packing = None
        if not args.no_packing:
            best = interleaved({style: update_fn(actors["bf16"], b, cfg)
                                for style, b in episodes.items()}, args.repeats, bar)
            packing = (result("concat", episodes["concat"], *best["concat"], *params),
                       result("individual", episodes["individual"], *best["individual"], *params))
    meta = {
        "command": run.command,
        "machine": machine(),
        "date": run.started,
        "load": run.load(),
        "model": args.model,
        "mbt": str(cfg.micro_batch_tokens),
        "bucket": str(cfg.length_bucket),
        "repeats": str(args.repeats),
        "auto": "bf16" if resolve_bf16("auto", torch.device("cpu")) else "fp32",
        "episodes": str(args.episodes),
    }
    section = render(meta, part1, peaks, params, parts, shared, packing)
    print(section)
    run.finish(section, {"throughput": [{"name": r.name, "seconds": r.seconds}
                                        for r in [*part1, *shared]], "peaks_gflops": peaks})


if __name__ == "__main__":
    main()
