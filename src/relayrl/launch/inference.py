"""Answer a prompt with a trained checkpoint (the service's last phase: use the trained model).

A launcher-level helper: it builds an engine. Imports: chat, engine, train (checkpoint paths).
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

from relayrl.chat.conversation import Conversation, Message, Role
from relayrl.chat.parsers import parse_reply
from relayrl.chat.renderer import Renderer
from relayrl.engine.local import LocalEngine
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


class TrainedPolicy:
    """A trained checkpoint loaded for generation: `await policy.generate(messages)`.

    `TrainedPolicy.load(experiment="math_agent", trial="main")` finds the latest checkpoint of a
    run (or `step=N`, or `checkpoint=DIR`); use it as `async with` to free the engine after.
    """

    def __init__(self, checkpoint: str | Path) -> None:
        self.checkpoint = Path(checkpoint)
        self.renderer = Renderer.from_pretrained(str(checkpoint))
        self.engine = LocalEngine(str(checkpoint))

    @classmethod
    def load(cls, experiment: str | None = None, trial: str | None = None,
             step: int | None = None, *, fileroot: str = "runs",
             checkpoint: str | Path | None = None) -> TrainedPolicy:
        """The policy of `experiment/trial` (latest step unless `step`), or of `checkpoint`."""
        path = checkpoint or find_checkpoint(fileroot, experiment, trial, step)
        return cls(path)

    async def generate(self, messages: list[dict[str, str]] | str, max_tokens: int = 256,
                       temperature: float = 0.0) -> str:
        """The reply to chat `messages` (or one user prompt); tool calls shown as text."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        conv = Conversation(tuple(Message(role=_role(m["role"]), content=m["content"])
                                  for m in messages))
        ids = self.renderer.render(conv)
        out = await self.engine.generate(GenerateRequest(ids, SamplingParams(
            max_new_tokens=max_tokens, temperature=temperature,
            stop_token_ids=self.renderer.stop_token_ids)))
        stops = set(self.renderer.stop_token_ids)
        reply = parse_reply(self.renderer.decode([t for t in out.output_ids if t not in stops]))
        calls = "".join(f"\n[tool call] {c.name}({c.arguments})" for c in reply.tool_calls)
        return reply.content + calls

    async def aclose(self) -> None:
        """Stop the engine."""
        await self.engine.aclose()

    async def __aenter__(self) -> TrainedPolicy:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def answer(checkpoint: str, prompt: str, max_tokens: int = 256,
                 system: str | None = None) -> str:
    """The model's greedy reply to one user message (reasoning and tool calls shown as text)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}]
    async with TrainedPolicy(checkpoint) as policy:
        return await policy.generate(messages, max_tokens=max_tokens)


def _role(value: str) -> Role:
    """`value` as a chat role; a ValueError naming the roles otherwise."""
    for role in get_args(Role):
        if value == role:
            return role
    raise ValueError(f"unknown role {value!r}: one of {', '.join(get_args(Role))}")
