"""relayrl.trajectory: recorded calls, the session tree, credit assignment, export and the log.

Imports neither torch nor pyarrow (both are imported inside the functions that need them), so the
gateway can use all of it on a machine without them.
"""

from relayrl.trajectory.credit import (
    CallTree,
    CreditRule,
    credit_rule,
    discounted_tree,
    outcome_broadcast,
    returns_to_go,
    returns_to_go_paths,
)
from relayrl.trajectory.export import EXPORT_STYLES, TrajectoryRow, export_session, to_tensor_dict
from relayrl.trajectory.interchange import (
    SCHEMA_VERSION,
    iter_jsonl,
    read_jsonl,
    read_parquet,
    row_from_dict,
    row_to_dict,
    write_jsonl,
    write_parquet,
)
from relayrl.trajectory.records import BranchReason, EventKind, Interaction, Segment
from relayrl.trajectory.session import (
    Located,
    Session,
    SessionJournal,
    SessionState,
    SessionStats,
    SessionStore,
    canonical_message,
)
from relayrl.trajectory.store import InteractionLog

__all__ = [
    "EXPORT_STYLES",
    "SCHEMA_VERSION",
    "BranchReason",
    "CallTree",
    "CreditRule",
    "EventKind",
    "Interaction",
    "InteractionLog",
    "Located",
    "Segment",
    "Session",
    "SessionJournal",
    "SessionState",
    "SessionStats",
    "SessionStore",
    "TrajectoryRow",
    "canonical_message",
    "credit_rule",
    "discounted_tree",
    "export_session",
    "iter_jsonl",
    "outcome_broadcast",
    "read_jsonl",
    "read_parquet",
    "returns_to_go",
    "returns_to_go_paths",
    "row_from_dict",
    "row_to_dict",
    "to_tensor_dict",
    "write_jsonl",
    "write_parquet",
]
