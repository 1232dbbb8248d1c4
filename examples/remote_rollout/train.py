"""The measured run of the remote rollout example, as one command.

    python examples/remote_rollout/train.py [dotted.overrides ...]

Starts the reference rollout server (`relayrl.remote_rollout`, the calculator agent) as a child
process on a free loopback port and points the config's `server_url` (training and eval) at it;
writes the SFT warm-up traces in the calculator's tool format (`calc_teacher.py`) unless
`sft.data` names some; then runs the trainer: held-out eval of the model as loaded, SFT
warm-start, eval before RL, GRPO steps in which every episode is a `POST /rollout` to the server,
eval after RL. Prints reward before/after and the wall time; stops the server on every path.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from relayrl.config import RelayConfig, load_config  # noqa: E402
from relayrl.launch import train  # noqa: E402
from relayrl.models import model_path  # noqa: E402
from relayrl.train.trainer import TrainResult, load_dataset  # noqa: E402


def with_server(cfg: RelayConfig, server_url: str) -> RelayConfig:
    """`cfg` with the rollout server's URL in the training and the eval workflow options."""
    def point(kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "server_url": server_url}

    ev = cfg.eval
    return replace(cfg, workflow_kwargs=point(dict(cfg.workflow_kwargs or {})),
                   eval=replace(ev, workflow_kwargs=point(dict(ev.workflow_kwargs))
                                if ev.workflow_kwargs else {}))


def main(argv: list[str]) -> TrainResult:
    """Start the server, write warm-up traces if needed, train, print the outcome."""
    from calc_teacher import generate_traces
    from run_episodes import free_port, start_server

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    started = time.perf_counter()
    cfg = load_config(RelayConfig, HERE / "config.yaml", argv)
    train_items = load_dataset(cfg.data.train)
    port = free_port()
    server = start_server(port)
    server_url = f"http://127.0.0.1:{port}"
    print(f"rollout server (child process {server.pid}) at {server_url}", flush=True)
    try:
        cfg = with_server(cfg, server_url)
        if cfg.sft.data is None:
            traces = cfg.run_dir / "warmup_traces.jsonl"
            if not traces.exists():
                n = cfg.sft.max_rows or 96
                print(f"generating {n} warm-up traces through the rollout server ...", flush=True)
                # the last items of the training set: RL samples the whole set anyway
                kwargs = cfg.workflow_kwargs
                generate_traces(model_path(cfg.model), train_items[-n:], n, server_url,
                                out_path=traces, max_turns=int(kwargs.get("max_turns", 4)))
            cfg = replace(cfg, sft=replace(cfg.sft, data=str(traces)))
        result = train(cfg, train_items, load_dataset(cfg.data.eval), workflow=cfg.workflow,
                       workflow_kwargs=cfg.workflow_kwargs,
                       eval_workflow_kwargs=cfg.eval.workflow_kwargs or None)
    finally:
        server.terminate()
        server.wait(10)
    print(result.summary())
    print(f"total wall time {(time.perf_counter() - started) / 60:.1f} min")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
