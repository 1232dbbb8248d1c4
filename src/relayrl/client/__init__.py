"""Clients of the gateway: `SessionClient` over HTTP, `DirectClient` (an OpenAI client made from
the engine a workflow is handed, `RunEngine`), and the
any-agent API (`AgentSession`, `AgentRunner`) that puts an unchanged agent's calls into sessions."""

from relayrl.client import redact
from relayrl.client.agent_runner import AgentRunner, RunSummary
from relayrl.client.agent_session import AgentSession
from relayrl.client.direct import DirectClient
from relayrl.client.engine import (
    GenerationHyperparameters,
    ModelRequest,
    ModelResponse,
    RunEngine,
)
from relayrl.client.session_client import SessionClient, SessionHandle

redact.install()  # session keys ride in URLs; httpx logs URLs at INFO

__all__ = ["AgentRunner", "AgentSession", "DirectClient", "GenerationHyperparameters",
           "ModelRequest", "ModelResponse", "RunEngine", "RunSummary", "SessionClient",
           "SessionHandle"]
