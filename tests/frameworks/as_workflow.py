"""One zoo example handed to the trainer's workflow machinery as `workflow: MODULE.run`.

`one_batch` does what a training run does with a workflow: `resolve_workflow` on the dotted path
with `workflow_kwargs`, then a `RolloutController` over the dataset until it yields a batch. Run
as a script (`python as_workflow.py MODULE GATEWAY_URL ADMIN_KEY`) it prints the result as one
JSON line, for examples that live in their own environment (CAMEL).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "frameworks"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))  # a config's workflow path resolves as the examples run

from relayrl.client.session_client import SessionClient  # noqa: E402
from relayrl.rollout import RolloutConfig, RolloutController  # noqa: E402
from relayrl.workflow import resolve_workflow  # noqa: E402


async def one_batch(module: str, gateway_url: str, admin_key: str,
                    task: dict[str, Any]) -> dict[str, Any]:
    """The first batch of `module.run` as a workflow over `[task]`: rewards and row shapes."""
    cfg = RolloutConfig(group_size=1, batch_size=1, max_concurrent_rollouts=1, epochs=1,
                        shuffle=False, progress=False, episode_timeout_s=120)
    async with SessionClient(gateway_url, admin_key) as client:
        wf = resolve_workflow(f"{module}.run", {"max_tokens": 64, "max_turns": 4},
                              gateway=client, agent_config=cfg.agent_config())
        rc = RolloutController(wf, [task], cfg)
        try:
            batches = [b async for b in rc]
            stats = rc.stats()
        finally:
            await rc.aclose()
            await wf.aclose()
    rows = [row for b in batches for row in b.rows.rows] if batches else []
    return {"workflow": type(wf).__name__, "agent": repr(getattr(wf, "agent", None)),
            "batches": len(batches), "rewards": [r.reward for r in rows],
            "trained_tokens": [int(sum(r.loss_mask)) for r in rows],
            "aborted": stats.aborted, "errors": list(stats.recent_errors)}


if __name__ == "__main__":
    from mathtask import TASK

    result = asyncio.run(one_batch(sys.argv[1], sys.argv[2], sys.argv[3], TASK))
    print(json.dumps(result))
