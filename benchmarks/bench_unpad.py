"""Unpadded micro-batches (`train.packing: unpad`, the default) against padded ones, interleaved.

Run by hand:  RELAYRL_HOME=/tmp/rr python benchmarks/bench_unpad.py [--rounds 5] [--random]
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

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from bench_train import (
    agent_batch,
    machine,
    matmul_peak_gflops,
    param_counts,
    synthetic_batch,
    update_fn,
)
from tqdm import tqdm

from relayrl.heap import keep_freed_heap
from relayrl.kernels import cpu as cpu_kernels
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train import attention, packing
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig


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


def main() -> None:
    """Time the rounds and print them."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--random", action="store_true", help="add pad/unpad arms on random rows")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    keep_freed_heap()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    path = model_path(args.model)
    unpad_cfg, pad_cfg = TrainConfig(), TrainConfig(packing="pad")
    unpad, pad = Actor(path, unpad_cfg), Actor(path, pad_cfg)
    vocab = unpad.model.config.vocab_size
    agents = agent_batch(16, vocab)
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
        rows = synthetic_batch(16, vocab)
        arms["random rows, unpad"] = update_fn(unpad, rows, unpad_cfg)
        arms["random rows, pad"] = update_fn(pad, rows, pad_cfg)
        tokens.update(dict.fromkeys(list(arms)[-2:], int(rows.lengths_B.sum())))
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    forward: dict[str, int] = {}
    trained: dict[str, int] = {}
    dtype = torch.bfloat16 if unpad.bf16 else torch.float32
    peaks = [matmul_peak_gflops(dtype)]
    with tqdm(total=len(arms) * (args.rounds + 1), desc="bench_unpad", unit="update") as bar:
        for r in range(args.rounds + 1):  # bounded: a warm-up round, then --rounds
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for name in order:
                start = time.perf_counter()
                metrics = arms[name]()
                elapsed = time.perf_counter() - start
                forward[name] = int(metrics["forward_tokens"])
                trained[name] = int(metrics["n_tokens"])
                if r > 0:
                    seconds[name].append(elapsed)
                bar.update(1)
    peaks.append(matmul_peak_gflops(dtype))
    body, head = param_counts(unpad.model)
    print(f"machine: {machine()}; bf16: {unpad.bf16}")
    print(f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    names = list(arms)
    print("| round | " + " | ".join(f"{n} s" for n in names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for i in range(args.rounds):
        print(f"| {i + 1} | " + " | ".join(f"{seconds[n][i]:.2f}" for n in names) + " |")
    for name in names:
        base = "random rows, unpad" if name.startswith("random") else "unpad"
        ratios = [a / b for a, b in zip(seconds[name], seconds[base], strict=True)]
        median = statistics.median(seconds[name])
        gflops = (6.0 * body * forward[name] + 6.0 * head * trained[name]) / median / 1e9
        print(f"{name}: forward tokens {forward[name]}, median {median:.2f} s, "
              f"{tokens[name] / median:.0f} tokens/s, {gflops:.0f} model GFLOP/s "
              f"({gflops / max(peaks):.1%} of the matmul peak); "
              f"{name} / {base} per round {', '.join(f'{x:.3f}' for x in ratios)}, "
              f"median {statistics.median(ratios):.3f}")
    print(f"{dtype} matmul peak (bench_train's 2048-cubed product) before and after the rounds: "
          f"{peaks[0]:.0f}, {peaks[1]:.0f} GFLOP/s; model FLOPs as bench_train counts them")


if __name__ == "__main__":
    main()
