"""The staleness rule, as a small counter with no I/O (so it can be tested exhaustively).

A new group is admitted only while `accepted + running <= (version + max_staleness + 1) *
batch_size` holds *after* admitting it, where `accepted` counts every group that produced rows
(handed to the trainer or waiting) and `running` the groups in flight. Rejected and aborted
groups give their slot back: they produce no rows, so counting them would starve the trainer
(it could never complete the batch that bumps the version).

What the rule bounds is how far sampling runs ahead of training: with one version per batch,
at most `max_staleness` batches' worth of groups exist beyond the one being trained. A straggler
admitted long ago can still finish late; its tokens carry their versions, which the trainer's
off-policy correction uses.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import CapacityExhausted


@dataclass
class StalenessGate:
    """Counts groups against the staleness rule."""

    batch_size: int
    max_staleness: int
    accepted: int = 0
    """Groups that produced rows, ever (handed out or queued)."""
    running: int = 0
    """Groups in flight."""

    def limit(self, version: int) -> int:
        """Most groups (accepted + running) allowed at `version`."""
        return (version + self.max_staleness + 1) * self.batch_size

    @property
    def submitted(self) -> int:
        """The count the rule bounds: accepted + running groups."""
        return self.accepted + self.running

    def capacity(self, version: int) -> int:
        """How many more groups may be admitted at `version`."""
        return max(0, self.limit(version) - self.submitted)

    def admit(self, version: int) -> None:
        """Count a new running group; CapacityExhausted if the rule forbids it."""
        if self.capacity(version) <= 0:
            raise CapacityExhausted(f"staleness rule: {self.submitted} groups submitted, limit "
                                    f"{self.limit(version)} at version {version}")
        self.running += 1

    def finish(self, accepted: bool) -> None:
        """A running group ended; it keeps its slot only if it produced rows."""
        assert self.running > 0, "finish() without a running group"
        self.running -= 1
        if accepted:
            self.accepted += 1
