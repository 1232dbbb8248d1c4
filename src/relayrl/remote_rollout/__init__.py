"""relayrl.remote_rollout: the remote rollout protocol, both sides.

The server side (schemas, `RolloutSession`, calculator tools, tokenizer cache, agent loop,
FastAPI app, `relayrl rollout-server`) is torch-free and imports nothing above relayrl's chat
layer. The trainer side, `RemoteRolloutWorkflow`, lives in `relayrl.remote_rollout.workflow` and
imports the client and workflow layers; it is not imported here, so a server never loads them.
"""

from relayrl.remote_rollout.config import ServerConfig
from relayrl.remote_rollout.executor import AppState, execute_rollout
from relayrl.remote_rollout.session import RolloutSession, TrainerCallError
from relayrl.remote_rollout.tokenizer import TokenizerCache, TokenizerLoadError, load_tokenizer
from relayrl.remote_rollout.tools import Calculator, ToolExecutionError

__all__ = [
    "AppState",
    "Calculator",
    "RolloutSession",
    "ServerConfig",
    "TokenizerCache",
    "TokenizerLoadError",
    "ToolExecutionError",
    "TrainerCallError",
    "execute_rollout",
    "load_tokenizer",
]
