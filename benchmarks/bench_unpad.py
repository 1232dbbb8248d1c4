"""Unpadded micro-batches (`train.packing: unpad`, the default) against padded ones, interleaved.

Run by hand:  RELAYRL_HOME=/tmp/rr python -m benchmarks unpad [--rounds 5] [--random]
              [--model DIR] [--threads 2]

Arms, each an actor on the default model with the default `TrainConfig` but for what is named:
`unpad` (the default: a micro-batch's rows end to end, padded only inside attention, each group's
question run once as a stem, its pieces in two length buckets where that saves attention work, its
attention as bf16 products on a CPU with bf16 units), `unpad, no stems` (the same with every row
running its question itself, as before stems), `unpad, one layout` (every piece padded to the
longest, as before `attention.buckets`), and `pad` (the default before it: rows padded to the
micro-batch's bucketed length); on a CPU with bf16 units, `unpad, no train kernels` (the
scores and the output head's logits as fp32 products of upcast copies, torch's softmax, and
RMSNorm, SwiGLU and the rotary embedding as torch's ops, as before `kernels/csrc/train_kernels.c`), `unpad, fp32 flash attention` (torch's SDPA in fp32 as well, as
before `attention.MATMUL_ON_CPU`) and `unpad, bf16 flash attention` (SDPA in bf16, as before
`attention.UPCAST_ON_CPU`). Each updates bench_train's 16 agent-shaped rows (a 313-token system
prompt, a question per group of 8, a tool call, its result and an answer); `--random` adds `pad`
and `unpad` arms on its 16 random rows of 394-472 tokens (no common prefix). A warm-up round, then
`--rounds` rounds, the arms' order reversed every other round so that the machine's load falls on
all. Printed: forward tokens per arm, every round's seconds, the per-round ratios against `unpad`
and their medians, each arm's model GFLOP/s as bench_train counts them and their share of the
matmul peak (bench_train's, measured before and after the rounds: the better of the two), and the
load average before and after. The process keeps its freed heap (`keep_freed_heap`, as the
launchers set it for a run; every arm runs under it). Speed only: tests/train/test_shared_prefix.py
and test_packing.py check that unpadded logprobs, gradients and steps equal padded ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from tqdm import tqdm

from benchmarks import harness
from benchmarks.bench_train import (
    agent_batch,
    matmul_peak_gflops,
    param_counts,
    synthetic_batch,
    update_fn,
)
from relayrl.heap import keep_freed_heap
from relayrl.kernels import cpu as cpu_kernels
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train import attention, packing
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig

NAME = "unpad"


def without_stems(update: Callable[[], dict[str, float]]) -> Callable[[], dict[str, float]]:
    """`update` with no stems planned: every row of an unpadded micro-batch runs its question."""

    def run() -> dict[str, float]:
        saved = packing.MIN_STEM
        packing.MIN_STEM = 1 << 30  # no run of rows shares that many tokens
        try:
            return update()
        finally:
            packing.MIN_STEM = saved

    return run


def patched(update: Callable[[], dict[str, float]], train_kernels: bool = True,
            **switches: object) -> Callable[[], dict[str, float]]:
    """`update` with `relayrl.train.attention`'s module switches set to these values, or without
    the trainer's kernels (`train_kernels=False`: fp32 products of upcast copies and torch's ops,
    as before them)."""

    def run() -> dict[str, float]:
        saved = {name: getattr(attention, name) for name in switches}
        kernel = cpu_kernels.train_kernels()
        for name, value in switches.items():
            setattr(attention, name, value)
        if not train_kernels:
            cpu_kernels._loaded["train_kernels"] = None
        try:
            return update()
        finally:
            for name, value in saved.items():
                setattr(attention, name, value)
            cpu_kernels._loaded["train_kernels"] = kernel

    return run


def main(argv: list[str] | None = None) -> None:
    """Time the rounds and print them."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--random", action="store_true", help="add pad/unpad arms on random rows")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    n_rows, peak_n = 16, 2048
    if args.smoke:
        args.model, args.rounds, n_rows, peak_n = harness.smoke_model(), 1, 2, 256  # 2 rows still share a stem
    run = harness.Run.start(NAME, args, argv)
    keep_freed_heap()
    torch.set_num_threads(args.threads)
    path = model_path(args.model)
    unpad_cfg, pad_cfg = TrainConfig(), TrainConfig(packing="pad")
    unpad, pad = Actor(path, unpad_cfg), Actor(path, pad_cfg)
    vocab = unpad.model.config.vocab_size
    agents = agent_batch(n_rows, vocab)
    arms: dict[str, Callable[[], dict[str, float]]] = {
        "unpad": update_fn(unpad, agents, unpad_cfg),
        "unpad, no stems": without_stems(update_fn(unpad, agents, unpad_cfg)),
        # no split saves that much
        "unpad, one layout": patched(update_fn(unpad, agents, unpad_cfg), BUCKET_MIN_SAVING=2.0),
        "pad": update_fn(pad, agents, pad_cfg),
    }
    if unpad.bf16:
        arms["unpad, no train kernels"] = patched(update_fn(unpad, agents, unpad_cfg), train_kernels=False)
        arms["unpad, fp32 flash attention"] = patched(update_fn(unpad, agents, unpad_cfg),
                                                      train_kernels=False, MATMUL_ON_CPU=False)
        arms["unpad, bf16 flash attention"] = patched(update_fn(unpad, agents, unpad_cfg),
                                                      train_kernels=False, MATMUL_ON_CPU=False,
                                                      UPCAST_ON_CPU=False)
    tokens = dict.fromkeys(arms, int(agents.lengths_B.sum()))
    if args.random:
        rows = synthetic_batch(n_rows, vocab)
        arms["random rows, unpad"] = update_fn(unpad, rows, unpad_cfg)
        arms["random rows, pad"] = update_fn(pad, rows, pad_cfg)
        tokens.update(dict.fromkeys(list(arms)[-2:], int(rows.lengths_B.sum())))
    dtype = torch.bfloat16 if unpad.bf16 else torch.float32
    peaks = [matmul_peak_gflops(dtype, peak_n)]
    with tqdm(total=len(arms) * (args.rounds + 1), desc="bench_unpad", unit="update") as bar:
        timed = harness.timed_rounds(arms, args.rounds, each=lambda *_: bar.update(1))
    seconds = timed.seconds
    forward = {name: int(m["forward_tokens"]) for name, m in timed.last.items()}
    trained = {name: int(m["n_tokens"]) for name, m in timed.last.items()}
    peaks.append(matmul_peak_gflops(dtype, peak_n))
    body, head = param_counts(unpad.model)
    run.say(f"bf16: {unpad.bf16}")
    run.say(f"load average before {run.load_before:.2f}, after {harness.load_average():.2f}")
    for line in harness.rounds_table(seconds):
        run.say(line)
    names = list(arms)
    for name in names:
        base = "random rows, unpad" if name.startswith("random") else "unpad"
        ratios = harness.per_round_ratios(seconds[name], seconds[base])
        median = statistics.median(seconds[name])
        gflops = (6.0 * body * forward[name] + 6.0 * head * trained[name]) / median / 1e9
        run.say(f"{name}: forward tokens {forward[name]}, median {median:.2f} s, "
              f"{tokens[name] / median:.0f} tokens/s, {gflops:.0f} model GFLOP/s "
              f"({gflops / max(peaks):.1%} of the matmul peak); "
              f"{name} / {base} per round {', '.join(f'{x:.3f}' for x in ratios)}, "
              f"median {statistics.median(ratios):.3f}")
    run.say(f"{dtype} matmul peak (bench_train's {peak_n}-cubed product) before and after the "
            f"rounds: {peaks[0]:.0f}, {peaks[1]:.0f} GFLOP/s; model FLOPs as bench_train counts "
            "them")
    run.finish(metrics={"seconds": seconds, "forward_tokens": forward, "peaks_gflops": peaks})


if __name__ == "__main__":
    main()
