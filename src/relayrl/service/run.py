"""`relayrl serve CONFIG [overrides]`: the any-agent RL service, until SIGINT/SIGTERM.

On a signal: new sessions are refused, the trainer finishes its step, a checkpoint is written,
sessions still open are aborted (never trained), the log is closed. Finalized but untrained
sessions stay in the log and are trained after a restart on the same log.

Imports: config, launch, train, service.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from relayrl.config import RelayConfig, dump_config, load_config
from relayrl.launch.process import keep_freed_heap
from relayrl.service.launcher import ServiceLauncher, ensure_admin_key
from relayrl.train.trainer import PPOTrainer, TrainResult


def serve_from_config(path: str | Path | None, overrides: Sequence[str] = ()) -> TrainResult:
    """Load the config and run the service until stopped; returns what the trainer produced."""
    cfg = load_config(RelayConfig, path, overrides)
    if cfg.gateway.log_path is None:  # a service must survive a crash: keep a durable log
        cfg = replace(cfg, gateway=replace(cfg.gateway, log_path=str(cfg.run_dir / "sessions.db")))
    cfg, key_file = ensure_admin_key(cfg)
    if cfg.train.keep_heap:
        keep_freed_heap()
    return asyncio.run(serve(cfg, key_file))


async def serve(cfg: RelayConfig, key_file: Path | None = None) -> TrainResult:
    """Run the service in the current event loop until `SIGINT`/`SIGTERM`.

    `key_file` holds the generated admin key, if one was generated: the lines printed for
    agents read it from there, so the key itself is never printed.
    """
    dump_config(cfg, cfg.run_dir / "config.yaml")
    launcher = ServiceLauncher(cfg, key_file=key_file)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, launcher.stop)
    try:
        trainer = PPOTrainer(cfg, [], None, launcher=launcher)
        return await trainer.atrain(workflow=None)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
