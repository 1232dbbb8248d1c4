"""relayrl.trajectory: recorded calls, the session tree, credit assignment, export, the durable
log, and the staleness rule.

Owns the names of export styles (`ExportStyle`) and credit rules (`CreditRule`) with their
defaults. Imports neither torch nor pyarrow (both are imported inside the functions that need
them), so the gateway can use all of it on a machine without them.

May import: `relayrl.types`, `relayrl.errors`, `relayrl.chat` (never engine, gateway or above).
"""

from relayrl.chat.conversation import canonical_message
from relayrl.trajectory.credit import (
    DEFAULT_CREDIT_RULE,
    CallTree,
    CreditFn,
    CreditRule,
    credit_rule,
    discounted_tree,
    outcome_broadcast,
    returns_to_go,
    returns_to_go_paths,
)
from relayrl.trajectory.export import (
    DEFAULT_EXPORT_STYLE,
    ExportStyle,
    TrajectoryRow,
    export_session,
    to_tensor_dict,
)
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
from relayrl.trajectory.records import (
    AbortedCall,
    BranchReason,
    EventKind,
    Interaction,
    Segment,
)
from relayrl.trajectory.session import (
    Located,
    Session,
    SessionJournal,
    SessionState,
    SessionStats,
    hash_key,
)
from relayrl.trajectory.staleness import StalenessGate, staleness_limit
from relayrl.trajectory.store import InteractionLog

__all__ = [
    "DEFAULT_CREDIT_RULE",
    "DEFAULT_EXPORT_STYLE",
    "SCHEMA_VERSION",
    "AbortedCall",
    "BranchReason",
    "CallTree",
    "CreditFn",
    "CreditRule",
    "EventKind",
    "ExportStyle",
    "Interaction",
    "InteractionLog",
    "Located",
    "Segment",
    "Session",
    "SessionJournal",
    "SessionState",
    "SessionStats",
    "StalenessGate",
    "TrajectoryRow",
    "canonical_message",
    "credit_rule",
    "discounted_tree",
    "export_session",
    "hash_key",
    "iter_jsonl",
    "outcome_broadcast",
    "read_jsonl",
    "read_parquet",
    "returns_to_go",
    "returns_to_go_paths",
    "row_from_dict",
    "row_to_dict",
    "staleness_limit",
    "to_tensor_dict",
    "write_jsonl",
    "write_parquet",
]
