"""Unpadded rows' attention: every piece padded to the longest (one SDPA call, as the actor does)
against the pieces split into two length buckets (two calls), forward and backward, one layer.

The piece lengths are the main job's (the completions of two RL steps of seed 1, 2026-11-29,
`rollout.dump_root` dumps); they attend to a 300-token shared prefix, as the agent's system prompt
and tools, with SmolLM2-135M's heads. A measurement for a change not made yet: the actor pads
every piece of a micro-batch to its longest. Run: `python -m benchmarks buckets`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from benchmarks import harness

NAME = "buckets"

HEADS, KV_HEADS, PREFIX, HEAD_DIM = 9, 3, 300, 64
STEPS = {
    "step 2": [32, 69, 69, 69, 69, 69, 70, 70, 71, 71, 71, 131, 132, 132, 133, 133],
    "step 7": [72, 75, 130, 130, 130, 130, 130, 135, 135, 136, 136, 136, 136, 191, 192, 192],
}


def one_call(lengths: Sequence[int]) -> Callable[[], None]:
    """Forward and backward of the pieces padded to their longest, one SDPA call."""
    rows, longest = len(lengths), max(lengths)
    keys = PREFIX + longest
    q = torch.randn(rows, HEADS, longest, HEAD_DIM, requires_grad=True)
    k = torch.randn(rows, KV_HEADS, keys, HEAD_DIM, requires_grad=True)
    v = torch.randn(rows, KV_HEADS, keys, HEAD_DIM, requires_grad=True)
    mask = torch.ones(longest, keys, dtype=torch.bool).tril(PREFIX)

    def run() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                       scale=HEAD_DIM ** -0.5).sum().backward()
    return run


def best_split(lengths: Sequence[int]) -> int:
    """Where sorted lengths split into two buckets with the least padded attention work."""
    ls = sorted(lengths)

    def work(part: Sequence[int]) -> int:
        return len(part) * part[-1] * (PREFIX + part[-1])
    return min(range(1, len(ls)), key=lambda i: work(ls[:i]) + work(ls[i:]))


def timed(calls: Sequence[Callable[[], None]], repeats: int = 6) -> float:
    """Milliseconds per round of `calls`, after one warm-up round."""
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv: list[str] | None = None) -> None:
    """Print one call against two buckets, twice per step's lengths, interleaved."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds per step")
    ap.add_argument("--repeats", type=int, default=6, help="timed repeats of a call in a round")
    args = ap.parse_args(argv)
    steps = STEPS
    if args.smoke:  # the first step's shortest pieces, once
        steps = {"step 2": STEPS["step 2"][:4]}
        args.rounds, args.repeats = 1, 1
    run = harness.Run.start(NAME, args, argv)
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for name, lengths in steps.items():
        ls = sorted(lengths)
        cut = best_split(ls)
        arms = {"one call": [one_call(ls)], "two buckets": [one_call(ls[:cut]),
                                                             one_call(ls[cut:])]}
        for r in range(args.rounds):
            ms = {arm: timed(arms[arm], args.repeats) for arm in harness.order(list(arms), r)}
            a, b = ms["one call"], ms["two buckets"]
            run.say(f"{name}: {len(ls)} pieces of {ls[0]}-{ls[-1]} tokens, buckets of {cut} and "
                    f"{len(ls) - cut}: one call {a:.1f} ms, two buckets {b:.1f} ms ({a / b:.2f}x)")
    run.finish()


if __name__ == "__main__":
    main()
