"""The main job: teach SmolLM2-135M to solve arithmetic with the math agent's tools, on CPU.

1. Warm-up traces: the real MathAgent runs through a real gateway whose engine is a scripted
   teacher (examples/math_agent/teacher.py), so the traces are exactly the tokens the agent will
   produce later; they are exported as trajectory rows.
2. `relayrl.launch.train` (PPOTrainer with everything in this process): held-out eval of the base model, a short SFT warm-start on the
   traces (the 135M model writes no tool calls by itself), held-out eval, GRPO steps with the
   agent running unchanged against the in-process gateway, held-out eval, checkpoint, plot.

    python examples/math_agent/train.py [dotted.overrides ...]
    python examples/math_agent/train.py seed=1,2,3 [...]   # one run per seed, then the mean
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from relayrl.config import RelayConfig, load_config  # noqa: E402
from relayrl.launch import keep_freed_heap, train  # noqa: E402
from relayrl.models import model_path  # noqa: E402
from relayrl.train.trainer import load_dataset  # noqa: E402


def main(argv: list[str]) -> None:
    """Generate the warm-up traces if needed, then train."""
    from teacher import generate_traces

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.perf_counter()
    cfg = load_config(RelayConfig, HERE / "config.yaml", argv)
    if cfg.train.keep_heap:  # before the teacher's gateway starts the first threads
        keep_freed_heap()
    train_items = load_dataset(cfg.data.train)
    if cfg.sft.data is None:
        traces = cfg.run_dir / "warmup_traces.jsonl"
        if not traces.exists():
            n = cfg.sft.max_rows or 96
            print(f"generating {n} warm-up traces with the scripted teacher ...", flush=True)
            traces.parent.mkdir(parents=True, exist_ok=True)
            # the last items of the training set: RL samples the whole set anyway
            generate_traces(model_path(cfg.model), train_items[-n:], n, out_path=traces)
        cfg = replace(cfg, sft=replace(cfg.sft, data=str(traces)))
    result = train(cfg, train_items, load_dataset(cfg.data.eval), workflow=cfg.workflow,
                   workflow_kwargs=cfg.workflow_kwargs,
                   eval_workflow_kwargs=cfg.eval.workflow_kwargs or None)
    print(result.summary())
    print(f"total wall time {(time.perf_counter() - started) / 60:.1f} min")


if __name__ == "__main__":
    if any(a.startswith("seed=") and "," in a for a in sys.argv[1:]):
        import seeds

        sys.exit(0 if all(r.returncode == 0 for r in seeds.main(sys.argv[1:])) else 1)
    main(sys.argv[1:])
