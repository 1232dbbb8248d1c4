"""Starting the trainer's data-parallel ranks: `train.world_size: W` runs W worker processes on
this machine with torch's own elastic launcher (what `torchrun --standalone` uses), rendezvous on
127.0.0.1, and returns rank 0's result.

Each worker runs the same function (`relayrl.launch.train`); inside a worker (`in_worker()`)
it trains instead of launching again, and `relayrl.train.distributed` joins the process group
from the environment the launcher set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK).
A job started by `torchrun` itself (several machines) is already a worker: pass
`train.world_size` equal to torchrun's world size and nothing here runs.

The elastic agent watches the workers: when one fails, it stops the others and raises
`ChildFailedError` naming the failed rank, so a crash on rank 0 never leaves followers waiting.

Imports: the standard library and torch (launch layer: may import anything below).
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import Any

WORKER_ENV = "TORCHELASTIC_RUN_ID"
"""Set by torch's elastic agent (and by torchrun) in every worker it starts."""


def in_worker() -> bool:
    """Whether this process is a rank started by torch's launcher (torchrun or ours)."""
    return WORKER_ENV in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch_workers(world_size: int, fn: Callable[..., Any], *args: Any,
                   **kwargs: Any) -> Any:
    """Run `fn(*args, **kwargs)` in `world_size` new processes on this machine; rank 0's result.

    `fn` and its arguments must pickle (spawned processes): a module-level function, configs,
    datasets, workflow names or picklable workflow objects.
    """
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=world_size,
        run_id=f"relayrl-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # port 0: a free one
        local_addr="127.0.0.1",  # MASTER_ADDR for the workers: this machine, on loopback
        max_restarts=0,  # a failed step is not retried: the run stops and says which rank
        start_method="spawn",
    )
    results = elastic_launch(config, _worker)(fn, args, kwargs)
    return results[0]


def _worker(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One rank: loopback gloo if the job is on this machine only, run `fn`, leave the group."""
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" not in os.environ:
        # the ranks share this machine's cores (torchrun sets OMP_NUM_THREADS=1 for the same reason)
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    lo = _loopback_interface()
    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost") and lo:
        # gloo binds to the address the host name resolves to unless told otherwise
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    try:
        return fn(*args, **kwargs)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (AttributeError, OSError):  # not on every platform
        return None
    return next((n for n in names if n == "lo" or n.startswith("lo0")), None)
