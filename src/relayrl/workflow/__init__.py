"""relayrl.workflow: episodes. `RolloutWorkflow`, agents as workflows, groups, context, dumps.

May import: `relayrl.client`, `relayrl.trajectory`, `relayrl.errors`, httpx; torch only inside
functions that build tensors, openai never (agents bring their own SDK).
"""

from relayrl.client.direct import DirectClient
from relayrl.client.engine import (
    GenerationHyperparameters,
    ModelRequest,
    ModelResponse,
    RunEngine,
)
from relayrl.workflow import context as workflow_context
from relayrl.workflow.agent import AgentConfig, AgentMode, AgentWorkflow
from relayrl.workflow.base import EpisodeResult, RolloutWorkflow, is_interaction_dict, to_rows
from relayrl.workflow.context import EpisodeContext, episode_scope, stat_scope
from relayrl.workflow.dump import TrajectoryDumper, tokenizer_decoder
from relayrl.workflow.grouped import (
    EpisodeOutcome,
    EpisodeStatus,
    GroupedWorkflow,
    merge_results,
    run_episode,
)
from relayrl.workflow.resolve import import_dotted, resolve_workflow
from relayrl.workflow.reward import AsyncRewardWrapper
from relayrl.workflow.tensors import (
    TensorDict,
    concat_padded,
    rows_from_tensor_dict,
    validate_tensor_dict,
)

__all__ = [
    "AgentConfig",
    "AgentMode",
    "AgentWorkflow",
    "AsyncRewardWrapper",
    "DirectClient",
    "EpisodeContext",
    "EpisodeOutcome",
    "EpisodeResult",
    "EpisodeStatus",
    "GenerationHyperparameters",
    "GroupedWorkflow",
    "ModelRequest",
    "ModelResponse",
    "RolloutWorkflow",
    "RunEngine",
    "TensorDict",
    "TrajectoryDumper",
    "concat_padded",
    "episode_scope",
    "import_dotted",
    "is_interaction_dict",
    "merge_results",
    "resolve_workflow",
    "rows_from_tensor_dict",
    "run_episode",
    "stat_scope",
    "to_rows",
    "tokenizer_decoder",
    "validate_tensor_dict",
    "workflow_context",
]
