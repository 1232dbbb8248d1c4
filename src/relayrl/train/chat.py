"""Answer a prompt with a trained checkpoint (seed 003, phase 3: use the trained model)."""

from __future__ import annotations

from pathlib import Path

from relayrl.chat.conversation import Conversation, Message
from relayrl.chat.parsers import parse_reply
from relayrl.chat.renderer import Renderer
from relayrl.errors import ConfigError
from relayrl.train.checkpoint import checkpoint_path, latest_checkpoint
from relayrl.types import GenerateRequest, SamplingParams


def find_checkpoint(fileroot: str, experiment: str | None, trial: str | None,
                    step: int | None = None) -> Path:
    """The checkpoint of `experiment/trial` at `step` (latest when None)."""
    if not experiment or not trial:
        raise ConfigError("give --checkpoint DIR, or --experiment and --trial")
    root = Path(fileroot) / experiment / trial / "checkpoints"
    found = checkpoint_path(root, step) if step is not None else latest_checkpoint(root)
    if found is None or not Path(found).is_dir():
        raise ConfigError(f"no checkpoint under {root}" + (f" for step {step}" if step else ""))
    return Path(found)


async def answer(checkpoint: str, prompt: str, max_tokens: int = 256,
                 system: str | None = None) -> str:
    """The model's greedy reply to one user message (reasoning and tool calls shown as text)."""
    from relayrl.engine.local import LocalEngine

    renderer = Renderer.from_pretrained(checkpoint)
    messages = ((Message(role="system", content=system),) if system else ()) + (
        Message(role="user", content=prompt),)
    ids = renderer.render(Conversation(messages))
    engine = LocalEngine(checkpoint)
    try:
        out = await engine.generate(GenerateRequest(ids, SamplingParams(
            max_new_tokens=max_tokens, temperature=0.0,
            stop_token_ids=renderer.stop_token_ids)))
    finally:
        await engine.aclose()
    text = renderer.decode([t for t in out.output_ids if t not in renderer.stop_token_ids])
    reply = parse_reply(text)
    calls = "".join(f"\n[tool call] {c.name}({c.arguments})" for c in reply.tool_calls)
    return reply.content + calls
