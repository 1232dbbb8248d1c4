"""The remote rollout protocol's wire schemas (pydantic only), one module per concern."""

from relayrl.remote_rollout.schemas.completions import (
    CompletionsChoice,
    CompletionsMessage,
    CompletionsRequest,
    CompletionsResponse,
)
from relayrl.remote_rollout.schemas.constants import (
    MAX_TOKENS_LIMIT,
    MAX_TURNS_LIMIT,
    VALID_MESSAGE_ROLES,
)
from relayrl.remote_rollout.schemas.messages import (
    FunctionCall,
    FunctionDefinition,
    Message,
    ToolCall,
    ToolDefinition,
    ToolsResponse,
)
from relayrl.remote_rollout.schemas.params import SamplingParams
from relayrl.remote_rollout.schemas.rollout import (
    FinishReason,
    RolloutMetrics,
    RolloutRequest,
    RolloutResponse,
    RolloutStatus,
)

__all__ = [
    "MAX_TOKENS_LIMIT",
    "MAX_TURNS_LIMIT",
    "VALID_MESSAGE_ROLES",
    "CompletionsChoice",
    "CompletionsMessage",
    "CompletionsRequest",
    "CompletionsResponse",
    "FinishReason",
    "FunctionCall",
    "FunctionDefinition",
    "Message",
    "RolloutMetrics",
    "RolloutRequest",
    "RolloutResponse",
    "RolloutStatus",
    "SamplingParams",
    "ToolCall",
    "ToolDefinition",
    "ToolsResponse",
]
