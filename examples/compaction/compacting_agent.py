"""A small agent that compacts its own history, written against the plain `openai` client.

Each episode: the user hands the agent a password to remember and some chatter, the history grows
past the agent's budget, so the agent asks the model for a summary (the compaction call), drops
the old turns and goes on from the summary alone. The final question needs the password: the
episode is rewarded 1.0 when the answer holds it, so the reward depends on what the summary kept.

The continuation call carries `X-RelayRL-Link: compaction; parent=<the summary's reply id>`: relayrl
then records it as a `compaction` segment under the call that wrote the summary, trains that call
with the episode's reward, and treats the summary text re-sent in the continuation as prompt
(docs/compaction.md). Any agent can do the same; Codex and Claude Code are recognised without it.

    python examples/compaction/compacting_agent.py --base-url URL --api-key KEY   # one episode
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Any

from openai import OpenAI

SYSTEM = "You are a helpful assistant. Keep answers short."
COMPACT_PROMPT = ("This conversation is about to be cleared. Write a one-line note for "
                  "yourself that keeps what matters, with every password exactly as written.")
SUMMARY_INTRO = "Your note from the earlier conversation: "
TEMPERATURE = 1.0
THINGS = ("blue locker", "garage door", "bike lock", "safe", "front gate", "storage box")
WORDS = ("walnut", "harbor", "meadow", "copper", "lantern", "violet", "maple", "falcon")
CHATTER = ("By the way, the weather is nice today.", "I had pasta for lunch.",
           "My cat is sleeping on the sofa.", "The train was late this morning.")


@dataclass(frozen=True)
class Task:
    """One episode's facts: what the password opens, the password, the chatter before compaction."""

    thing: str
    code: str
    chatter: tuple[str, ...]

    @classmethod
    def sample(cls, rng: random.Random) -> Task:
        """A random task (a one-word password, one line of chatter)."""
        return cls(rng.choice(THINGS), rng.choice(WORDS), tuple(rng.sample(CHATTER, 1)))

    def to_dict(self) -> dict[str, Any]:
        """JSON form (a dataset item)."""
        return {"thing": self.thing, "code": self.code, "chatter": list(self.chatter)}


@dataclass(frozen=True)
class Episode:
    """What one run of the agent did."""

    summary: str
    answer: str
    reward: float
    summary_id: str


def _ask(client: OpenAI, messages: list[dict[str, str]], max_tokens: int,
         headers: dict[str, str] | None = None) -> tuple[str, str]:
    r = client.chat.completions.create(model="policy", messages=messages,  # type: ignore[arg-type]
                                       max_tokens=max_tokens, temperature=TEMPERATURE,
                                       extra_headers=headers)
    return r.choices[0].message.content or "", r.id


def run_episode(client: OpenAI, task: Task, budget_messages: int = 4) -> Episode:
    """Remember, chat, compact when the history passes its budget, answer from the summary."""
    history = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": f"Remember this: the password for the {task.thing} "
                                           f"is {task.code}."}]
    for line in task.chatter:
        reply, _ = _ask(client, history, 24)
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": line}]
    reply, _ = _ask(client, history, 24)
    history.append({"role": "assistant", "content": reply})
    if len(history) <= budget_messages:
        raise ValueError("the history never passed the budget: nothing to compact")
    # compaction: the model writes the summary (an action of the episode, trained)
    summary, summary_id = _ask(client, [*history, {"role": "user", "content": COMPACT_PROMPT}],
                               48)
    compacted = [{"role": "system", "content": SYSTEM},
                 {"role": "user", "content": f"{SUMMARY_INTRO}{summary}\n\nWhat is the password "
                                             f"for the {task.thing}? Reply with the password only."}]
    answer, _ = _ask(client, compacted, 16,
                     headers={"X-RelayRL-Link": f"compaction; parent={summary_id}"})
    return Episode(summary, answer, 1.0 if task.code.lower() in answer.lower() else 0.0,
                   summary_id)


def main() -> None:
    """One episode against a session URL (`relayrl gateway` + a session's key)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", required=True, help="the session's OpenAI base URL (…/v1)")
    p.add_argument("--api-key", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    ep = run_episode(client, Task.sample(random.Random(args.seed)))
    print(f"summary: {ep.summary!r}\nanswer: {ep.answer!r}\nreward: {ep.reward}")


if __name__ == "__main__":
    main()
