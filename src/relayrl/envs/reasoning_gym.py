"""reasoning-gym's procedural datasets as relayrl episodes, scored by their own `score_answer`.

    items = make_items("leg_counting", size=256, seed=1)        # a training set
    held_out = make_items("leg_counting", size=64, seed=2)      # another seed: other questions
    train(cfg, items, held_out, workflow="relayrl.envs.reasoning_gym:ReasoningGymAgent")

An item names its question by the dataset, its settings, seed, size and index
(`{"question", "answer", "reasoning_gym": {...}}`); the agent regenerates the entry from the
package itself, so the scorer sees exactly the entry reasoning-gym made, metadata included. A
JSONL of entries reasoning-gym wrote itself (`question`, `answer`, `metadata.source_dataset`) is
accepted too. `python -m relayrl.envs.reasoning_gym` writes items to JSONL for `relayrl train`.

`ReasoningGymAgent` is an ordinary agent: it asks the policy the question through the episode's
session URL with the OpenAI SDK (a system prompt from reasoning-gym's own set, the question as
the user message), takes the text inside the last `<answer>...</answer>` (reasoning-gym's
convention; `answer_tag=None` scores the whole reply; `answer_pattern=REGEX` takes the last match
of REGEX instead, e.g. the last number) and returns the dataset's own score. With
`curriculum=...` training episodes follow the dataset's reasoning-gym curriculum: the level goes up
when the recent training episodes score well and down when they score badly; every episode of a
group gets the same level; held-out episodes keep the item's own settings.

May import: `relayrl.workflow`, `relayrl.errors`; reasoning-gym and openai only inside functions.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from relayrl.errors import ConfigError, InvalidRequest
from relayrl.workflow import AsyncRewardWrapper
from relayrl.workflow.context import get as current_context

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

PIP_INSTALL = "pip install 'reasoning-gym>=0.1.19,<0.2'"
"""What to run when reasoning-gym is missing (also in `pip install 'relayrl[reasoning-gym]'`)."""

SPEC_KEY = "reasoning_gym"
"""The item key that names an entry: dataset, config, seed, size, index."""


def require() -> ModuleType:
    """The `reasoning_gym` package; ImportError with the pip command when it is not installed."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"relayrl.envs.reasoning_gym needs the reasoning-gym package: "
                          f"{PIP_INSTALL} (or pip install 'relayrl[reasoning-gym]')") from e
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset reasoning-gym registers, sorted."""
    require()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def check_dataset(name: str) -> None:
    """ConfigError naming the closest datasets when reasoning-gym has none called `name`."""
    names = dataset_names()
    if name in names:
        return
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    hint = (f"did you mean {', '.join(close)}?" if close
            else "`python -m relayrl.envs.reasoning_gym --list` lists them")
    raise ConfigError(f"reasoning-gym has no dataset {name!r} ({len(names)} datasets); {hint}")


def build_dataset(name: str, *, seed: int, size: int,
                  config: Mapping[str, Any] | None = None) -> Any:
    """reasoning-gym's own dataset object; ConfigError for an unknown name or bad settings."""
    check_dataset(name)
    if size < 1:
        raise ConfigError(f"reasoning-gym dataset {name!r}: size must be >= 1, got {size}")
    rg = require()
    from reasoning_gym.factory import DATASETS

    settings = dict(config or {})
    for key in ("seed", "size"):
        if key in settings:
            raise ConfigError(f"reasoning-gym dataset {name!r}: give {key} on its own, "
                              f"not inside config")
    try:
        return rg.create_dataset(name, seed=seed, size=size, **settings)
    except TypeError as e:
        fields = sorted(f for f in getattr(DATASETS[name][1], "__dataclass_fields__", {})
                        if f not in ("seed", "size"))
        raise ConfigError(f"reasoning-gym dataset {name!r} does not take config "
                          f"{sorted(settings)} ({e}); its settings: {fields}") from e
    except (AssertionError, ValueError) as e:
        raise ConfigError(f"reasoning-gym dataset {name!r} refused config {settings}: "
                          f"{e or type(e).__name__}") from e


def make_items(dataset: str, *, size: int, seed: int,
               config: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """`size` items of `dataset` generated with `seed` (a different seed: a held-out set)."""
    ds = build_dataset(dataset, seed=seed, size=size, config=config)
    spec = {"dataset": dataset, "config": dict(config or {}), "seed": seed, "size": size}
    items = []
    for index in range(size):
        entry = ds[index]
        items.append({"question": entry["question"], "answer": str(entry["answer"]),
                      SPEC_KEY: {**spec, "index": index}})
    return items


def write_items(path: str | Path, items: Sequence[Mapping[str, Any]]) -> Path:
    """Write items as JSONL (what `data.train` / `data.eval` read); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")
    return path


LAST_NUMBER = r"-?\d+(?:\.\d+)?"
"""An `answer_pattern` for numeric answers: the last number in the reply (`7 + 8 = 15.` -> 15)."""


def answer_regex(pattern: str | None) -> re.Pattern[str] | None:
    """`pattern` compiled (None stays None); ConfigError for a regex that does not compile."""
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"answer_pattern {pattern!r} is not a regular expression: {e}") from e


def extract_answer(reply: str, tag: str | None = "answer",
                   pattern: str | re.Pattern[str] | None = None) -> str | None:
    """The answer in `reply`: the last match of `pattern` (its first group if it has one) when
    given, else reasoning-gym's extraction (the last `<tag>...</tag>`), else the whole reply."""
    regex = answer_regex(pattern) if isinstance(pattern, str) else pattern
    if regex is not None:
        found = list(regex.finditer(reply))
        if not found:
            return None
        text = found[-1].group(1 if regex.groups else 0) or ""
        return text.strip() or None
    if tag is None:
        return reply.strip() or None
    require()
    from reasoning_gym.utils import extract_answer as rg_extract

    return rg_extract(reply, tag_name=tag)


def system_prompt_text(prompt: str | None) -> str | None:
    """A reasoning-gym system prompt by name (`default`, `direct`, ...), or literal text."""
    if not prompt:
        return None
    require()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if prompt in SYSTEM_PROMPTS:
        return str(SYSTEM_PROMPTS[prompt])
    if any(c.isspace() for c in prompt):
        return prompt
    raise ConfigError(f"system_prompt {prompt!r} is neither one of reasoning-gym's "
                      f"{sorted(SYSTEM_PROMPTS)} nor a prompt text")


@dataclass(frozen=True)
class CurriculumSettings:
    """When a dataset's reasoning-gym curriculum moves between levels (training episodes only)."""

    start_level: int = 0          # every attribute's level at the start
    window: int = 32              # training episodes at the current level per decision
    raise_at: float = 0.7         # mean score over the window at or above which the level goes up
    lower_at: float | None = None  # at or below which it goes down (None: never)

    def __post_init__(self) -> None:
        if self.start_level < 0 or self.window < 1 or not 0 <= self.raise_at <= 1:
            raise ConfigError("curriculum: need start_level >= 0, window >= 1, "
                              "0 <= raise_at <= 1")
        if self.lower_at is not None and not 0 <= self.lower_at < self.raise_at:
            raise ConfigError("curriculum: need 0 <= lower_at < raise_at")


class Curriculum:
    """One dataset's reasoning-gym curriculum and the scores that move it."""

    def __init__(self, dataset: str, settings: CurriculumSettings) -> None:
        check_dataset(dataset)
        from reasoning_gym.factory import create_curriculum, has_curriculum

        if not has_curriculum(dataset):
            from reasoning_gym.factory import CURRICULA

            raise ConfigError(f"reasoning-gym has no curriculum for {dataset!r}; these have "
                              f"one: {', '.join(sorted(CURRICULA))}")
        self.dataset = dataset
        self.settings = settings
        self.curriculum = create_curriculum(dataset)
        self.curriculum.set_global_level(settings.start_level)
        self.scores: deque[float] = deque(maxlen=settings.window)
        self.changes = 0

    @property
    def level(self) -> int:
        """The highest level among the curriculum's attributes."""
        return int(self.curriculum.get_max_level())

    def config(self, level: int, base: Mapping[str, Any]) -> dict[str, Any]:
        """The dataset settings at `level` (`base` fills what the curriculum does not set)."""
        from reasoning_gym.factory import create_curriculum

        at_level = create_curriculum(self.dataset)  # a copy: the live one keeps its levels
        at_level.set_global_level(level)
        generated = at_level.generate_configuration(defaults=dict(base))
        return {k: v for k, v in vars(generated).items() if k not in ("seed", "size")}

    def record(self, score: float, level: int) -> None:
        """Count a training episode played at `level`; move the level when the window is full."""
        if level != self.level:
            return  # played before the last change: says nothing about the current level
        self.scores.append(score)
        if len(self.scores) < self.settings.window:
            return
        mean = sum(self.scores) / len(self.scores)
        moved = False
        if mean >= self.settings.raise_at:
            moved = bool(self.curriculum.increment_global_level())
        elif self.settings.lower_at is not None and mean <= self.settings.lower_at:
            moved = bool(self.curriculum.decrement_global_level())
        self.scores.clear()
        self.changes += moved


@dataclass(frozen=True)
class Question:
    """One entry to ask: its dataset's name and object, the entry, the curriculum level."""

    name: str
    dataset: Any
    entry: dict[str, Any]
    level: int | None = None


def _score(dataset: Any, answer: str | None, entry: dict[str, Any]) -> float:
    return float(dataset.score_answer(answer, entry))


class ReasoningGymAgent:
    """Answers one reasoning-gym question through the session URL; returns the dataset's score."""

    def __init__(self, model: str = "default", max_tokens: int = 256, temperature: float = 1.0,
                 system_prompt: str | None = "default", answer_tag: str | None = "answer",
                 answer_pattern: str | None = None,
                 curriculum: Mapping[str, Any] | None = None,
                 score_timeout_s: float = 15.0) -> None:
        if max_tokens < 1 or temperature < 0:
            raise ConfigError("need max_tokens >= 1 and temperature >= 0")
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.system_prompt = system_prompt_text(system_prompt)
        self.answer_tag = answer_tag or None
        self.answer_pattern = answer_pattern or None
        answer_regex(self.answer_pattern)  # a bad regex fails here, not in every episode
        try:
            self.curriculum_settings = (CurriculumSettings(**curriculum)
                                        if curriculum is not None else None)
        except TypeError as e:
            raise ConfigError(f"curriculum: {e}; its keys: start_level, window, raise_at, "
                              "lower_at") from e
        self.reward = AsyncRewardWrapper(_score, timeout_s=score_timeout_s)
        self._datasets: dict[str, Any] = {}
        self._curricula: dict[str, Curriculum] = {}
        self._group_levels: OrderedDict[str, int] = OrderedDict()
        self._episodes = 0
        self._tagged = 0
        self._full = 0
        self._score_sum = 0.0

    def __getstate__(self) -> dict[str, Any]:
        # subprocess mode pickles the agent: each worker regenerates its own datasets
        return {**self.__dict__, "_datasets": {}, "_curricula": {}}

    def messages(self, question: str) -> list[ChatCompletionMessageParam]:
        """The chat the policy sees: reasoning-gym's system prompt, then the question."""
        chat: list[ChatCompletionMessageParam] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        return [*chat, {"role": "user", "content": question}]

    def question(self, data: Mapping[str, Any]) -> Question:
        """The entry `data` names, regenerated by reasoning-gym (at the group's level)."""
        spec = data.get(SPEC_KEY)
        if isinstance(spec, Mapping):
            return self._from_spec(spec)
        metadata = data.get("metadata")
        name = metadata.get("source_dataset") if isinstance(metadata, Mapping) else None
        if isinstance(name, str) and "question" in data and "answer" in data:
            return Question(name, self._dataset(name, 0, 1, {}), dict(data))
        raise InvalidRequest(f"a reasoning-gym item needs {SPEC_KEY!r} (from make_items) or "
                             "question, answer and metadata.source_dataset (a reasoning-gym "
                             f"entry); got keys {sorted(data)}")

    def _from_spec(self, spec: Mapping[str, Any]) -> Question:
        try:
            name, seed, size = str(spec["dataset"]), int(spec["seed"]), int(spec["size"])
            index = int(spec["index"])
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidRequest(f"{SPEC_KEY} needs dataset, seed, size and index: {e}") from e
        if not 0 <= index < size:
            raise InvalidRequest(f"{SPEC_KEY}: index {index} outside a dataset of size {size}")
        config = dict(spec.get("config") or {})
        curriculum = self._curriculum(name)
        ctx = current_context()
        if curriculum is None or ctx.is_eval:  # held-out episodes keep the item's settings
            dataset = self._dataset(name, seed, size, config)
            return Question(name, dataset, dataset[index])
        level = self._group_level(ctx.group_id, curriculum)
        dataset = self._dataset(name, seed, size, config, level, curriculum)
        return Question(name, dataset, dataset[index], level)

    def _dataset(self, name: str, seed: int, size: int, config: dict[str, Any],
                 level: int | None = None, curriculum: Curriculum | None = None) -> Any:
        key = json.dumps([name, seed, size, config, level], sort_keys=True, default=str)
        if key not in self._datasets:
            if len(self._datasets) >= 64:
                self._datasets.pop(next(iter(self._datasets)))
            if curriculum is not None and level is not None:
                config = curriculum.config(level, config)
            self._datasets[key] = build_dataset(name, seed=seed, size=size, config=config)
        return self._datasets[key]

    def _curriculum(self, name: str) -> Curriculum | None:
        if self.curriculum_settings is None:
            return None
        if name not in self._curricula:
            self._curricula[name] = Curriculum(name, self.curriculum_settings)
        return self._curricula[name]

    def _group_level(self, group_id: str, curriculum: Curriculum) -> int:
        """The level the group's first episode saw: a group's episodes answer one question."""
        if not group_id:
            return curriculum.level
        if group_id not in self._group_levels:
            self._group_levels[group_id] = curriculum.level
            while len(self._group_levels) > 4096:
                self._group_levels.popitem(last=False)
        return self._group_levels[group_id]

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        """Ask the question, score the answer with the dataset's `score_answer`."""
        from openai import AsyncOpenAI

        q = self.question(data)
        client = AsyncOpenAI(
            base_url=extra_kwargs.get("base_url") or os.environ["OPENAI_BASE_URL"],
            api_key=extra_kwargs.get("api_key") or os.environ["OPENAI_API_KEY"],
            http_client=extra_kwargs.get("http_client"), max_retries=0)
        try:
            completion = await client.chat.completions.create(
                model=self.model, messages=self.messages(q.entry["question"]),
                max_tokens=self.max_tokens, temperature=self.temperature)
        finally:
            if extra_kwargs.get("http_client") is None:
                await client.close()  # ours to close, on this loop
        reply = completion.choices[0].message.content or ""
        answer = extract_answer(reply, self.answer_tag, self.answer_pattern)
        score = await self.reward(q.dataset, answer, q.entry)
        self._count(answer is not None, score)
        if q.level is not None:
            self._curricula[q.name].record(score, q.level)
        return score

    def _count(self, answered: bool, score: float) -> None:
        self._episodes += 1
        self._tagged += answered
        self._full += score >= 1.0
        self._score_sum += score

    def counters(self) -> dict[str, float]:
        """Episodes; shares with an answer found (format compliance) and with full marks; levels."""
        out: dict[str, float] = {"episodes": self._episodes}
        if self._episodes:
            out["answer_rate"] = self._tagged / self._episodes
            out["full_score_rate"] = self._full / self._episodes
            out["mean_score"] = self._score_sum / self._episodes
        for name, curriculum in self._curricula.items():
            out[f"{name}_level"] = curriculum.level
            out[f"{name}_level_changes"] = curriculum.changes
        return out


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m relayrl.envs.reasoning_gym DATASET --size N --seed S --out FILE.jsonl`."""
    p = argparse.ArgumentParser(prog="python -m relayrl.envs.reasoning_gym",
                                description="Write reasoning-gym items as JSONL for relayrl.")
    p.add_argument("dataset", nargs="?", help="a reasoning-gym dataset name, e.g. leg_counting")
    p.add_argument("--size", type=int, default=256, help="how many items")
    p.add_argument("--seed", type=int, default=1, help="another seed gives a held-out set")
    p.add_argument("--config", default="{}", help="the dataset's settings as JSON")
    p.add_argument("--out", help="JSONL path (default: stdout)")
    p.add_argument("--list", action="store_true", help="list the datasets and exit")
    args = p.parse_args(argv)
    if args.list:
        print("\n".join(dataset_names()))
        return 0
    if not args.dataset:
        p.error("name a dataset (or --list)")
    try:
        config = json.loads(args.config)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
        items = make_items(args.dataset, size=args.size, seed=args.seed, config=config)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        print(f"wrote {len(items)} items to {write_items(args.out, items)}", file=sys.stderr)
    else:
        for item in items:
            print(json.dumps(item))
    return 0


if __name__ == "__main__":
    sys.exit(main())
