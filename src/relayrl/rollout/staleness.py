"""The rollout controller's staleness gate: the rule itself lives in `relayrl.trajectory.staleness`
(one definition, shared with the gateway's `grant_capacity`); this name stays for the controller.

May import: `relayrl.trajectory.staleness` only.
"""

from relayrl.trajectory.staleness import StalenessGate

__all__ = ["StalenessGate"]
