"""The SFT replay (PPO-ptx) scored in the RL rows' micro-batches against a pass of its own.

Run by hand:  RELAYRL_HOME=/tmp/rr python -m benchmarks replay [--rounds 5] [--threads 2]

The main job adds `train.sft_replay_rows` (4) warm-up traces to every RL update. They start
with the agent's system prompt like the RL rows, so `Actor.update` scores them in the RL rows'
micro-batches and the prompt's prefix pass runs once. Arms, on one actor of the default model
with the default `TrainConfig` (`sft_replay_coef` 1), each updating bench_train's agent-shaped
rows (16 RL rows in groups of 8, 4 replay rows of a third question, one 313-token system
prompt):
`one pass` is `update(batch, adv, replay=...)`; `two passes` is the work of the code before it:
`update(batch, adv)` (RL forward, backward and the optimizer step) and then `nll_backward` of
the replay rows in micro-batches of their own (the same forward and backward work as when the
replay ran before the step; its gradients are dropped by the next update). Interleaved rounds
after a warm-up, the order reversed every other round; the process keeps its freed heap as the
launchers set it. Speed only: tests/train/test_actor.py checks the one-pass step against the
two losses taken apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from tqdm import tqdm

from benchmarks import harness
from benchmarks.bench_train import agent_batch
from relayrl.heap import keep_freed_heap
from relayrl.models import DEFAULT_MODEL, model_path
from relayrl.train.actor import Actor
from relayrl.train.advantages import compute_advantages
from relayrl.train.config import TrainConfig

NAME = "replay"
RL_ROWS, REPLAY_ROWS = 16, 4


def main(argv: list[str] | None = None) -> None:
    """Time the rounds and print them."""
    ap = harness.parser(NAME, __doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds after the warm-up")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    rl_rows, replay_rows = RL_ROWS, REPLAY_ROWS
    if args.smoke:
        args.model, args.rounds, rl_rows, replay_rows = harness.smoke_model(), 1, 4, 2
    run = harness.Run.start(NAME, args, argv)
    keep_freed_heap()
    torch.set_num_threads(args.threads)
    cfg = TrainConfig(sft_replay_coef=1.0)
    actor = Actor(model_path(args.model), cfg)
    rows = agent_batch(rl_rows + replay_rows, actor.model.config.vocab_size)
    adv = compute_advantages(rows.select(range(rl_rows)), cfg)
    batch, replay = adv.batch, rows.select(range(rl_rows, rl_rows + replay_rows))
    forward: dict[str, int] = {}

    def one_pass() -> None:
        forward["one pass"] = int(actor.update(batch, adv.adv_B_T, replay=replay)["forward_tokens"])

    def two_passes() -> None:
        rl = int(actor.update(batch, adv.adv_B_T)["forward_tokens"])
        actor.nll_backward(replay, cfg.sft_replay_coef)
        forward["two passes"] = rl + sum(mb.num_tokens for mb in actor.micro_batches(replay))

    arms: dict[str, Callable[[], None]] = {"one pass": one_pass, "two passes": two_passes}
    with tqdm(total=len(arms) * (args.rounds + 1), desc="bench_replay", unit="update") as bar:
        seconds = harness.timed_rounds(arms, args.rounds, each=lambda *_: bar.update(1)).seconds
    run.say(f"bf16: {actor.bf16}")
    run.say(f"load average before {run.load_before:.2f}, after {harness.load_average():.2f}")
    for line in harness.rounds_table(seconds):
        run.say(line)
    ratios = harness.per_round_ratios(seconds["two passes"], seconds["one pass"])
    for name in arms:
        run.say(f"{name}: forward tokens {forward[name]}, "
                f"median {statistics.median(seconds[name]):.2f} s")
    run.say(f"two passes / one pass per round {', '.join(f'{x:.3f}' for x in ratios)}, "
            f"median {statistics.median(ratios):.3f}")
    run.finish(metrics={"seconds": seconds, "forward_tokens": forward})


if __name__ == "__main__":
    main()
