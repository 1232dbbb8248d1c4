"""The staleness rule, the one definition the rollout controller and the gateway both count with:
a small counter with no I/O (so it can be tested exhaustively).

An item (a group of episodes for the controller, a session for the gateway; the caller picks the
unit and sizes `batch_size` in it) is admitted only while `accepted + running <= (version +
max_staleness + 1) * batch_size` holds *after* admitting it. `accepted` counts every item that
produced rows (handed to the trainer or waiting), `running` the items in flight. Rejected and
aborted items give their slot back: they produce no rows, so counting them would starve the
trainer (it could never complete the batch that bumps the version).

What the rule bounds is how far sampling runs ahead of training: with one version per batch,
at most `max_staleness` batches' worth of items exist beyond the one being trained. A straggler
admitted long ago can still finish late; its tokens carry their versions, which the trainer's
off-policy correction uses.

May import: `relayrl.errors` only.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayrl.errors import CapacityExhausted, InvalidRequest


def staleness_limit(version: int, max_staleness: int, batch_size: int) -> int:
    """Most items (accepted + running) allowed at `version`: (version + max_staleness + 1) * batch."""
    return (version + max_staleness + 1) * batch_size


@dataclass
class StalenessGate:
    """Counts items against the staleness rule."""

    batch_size: int
    max_staleness: int
    accepted: int = 0
    """Items that produced rows, ever (handed out or queued)."""
    running: int = 0
    """Items in flight."""

    def __post_init__(self) -> None:
        self.set_rule(self.max_staleness, self.batch_size)

    def set_rule(self, max_staleness: int, batch_size: int) -> None:
        """Change the rule's parameters; the counts stay (the gateway's caller may resend them)."""
        if max_staleness < 0 or batch_size < 1:
            raise InvalidRequest(f"need max_staleness >= 0 and batch_size >= 1; got "
                                 f"{max_staleness}, {batch_size}")
        self.max_staleness = max_staleness
        self.batch_size = batch_size

    def limit(self, version: int) -> int:
        """Most items (accepted + running) allowed at `version`."""
        return staleness_limit(version, self.max_staleness, self.batch_size)

    @property
    def submitted(self) -> int:
        """The count the rule bounds: accepted + running items."""
        return self.accepted + self.running

    def capacity(self, version: int) -> int:
        """How many more items may be admitted at `version`."""
        return max(0, self.limit(version) - self.submitted)

    def admit(self, version: int) -> None:
        """Count a new running item; CapacityExhausted if the rule forbids it."""
        if self.capacity(version) <= 0:
            raise CapacityExhausted(f"staleness rule: {self.submitted} submitted, limit "
                                    f"{self.limit(version)} at version {version}")
        self.running += 1

    def add(self) -> None:
        """Count a running item without checking the rule (one admitted before the rule was set,
        or rebuilt from the durable log)."""
        self.running += 1

    def finish(self, accepted: bool) -> None:
        """A running item ended; it keeps its slot only if it produced rows."""
        assert self.running > 0, "finish() without a running item"
        self.running -= 1
        if accepted:
            self.accepted += 1


__all__ = ["StalenessGate", "staleness_limit"]
