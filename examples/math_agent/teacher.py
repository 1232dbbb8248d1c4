"""An oracle policy for the math agent, and the SFT traces it leaves when run through the gateway.

    RELAYRL_HOME=/tmp/rr python examples/math_agent/teacher.py --n 128 --out /tmp/traces.jsonl

`teacher_script(decoder)` is a script for `FakeEngine`: it reads the prompt the gateway rendered
(ChatML with Hermes-style tools), finds the question (the last user turn that is not a tool
response) and the tool results after it, and writes the next correct step: a `<tool_call>` for the
next operation (innermost first, its operands taken from the earlier results) or, once every
result is in, "The answer is N.". Tool calls are written with the JSON spacing the chat template
uses when it renders a call back into the history, so the sampled tokens are the tokens a full
render of the episode would hold.

`generate_traces(model_dir, tasks, n)` runs the real `MathAgent` (openai-agents, real HTTP) through
a real gateway on loopback whose engine is `FakeEngine(teacher)`, and exports each episode as one
`concat` row: the exact prompt and reply ids the agent produced, with the loss mask on the model's
own turns. Those rows are the SFT warm-up data of the math job.

Tradeoff: the teacher reads the question's text, not the dataset's answer, so a question it cannot
parse fails loudly instead of being answered from the label; in return every trace it writes was
graded by the agent's own reward function, and one that is not rewarded 1.0 is an error.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import inspect
import json
import re
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from relayrl.errors import EpisodeFailed, InvalidRequest
from relayrl.types import GenerateRequest

HERE = Path(__file__).resolve().parent
QUESTION = re.compile(r"What is (.+?)\?")
"""The expression inside a question of `tasks.py` or `math.jsonl`."""
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
TOOL_NAMES: dict[type[ast.operator], str] = {ast.Add: "add", ast.Mult: "multiply"}
TEACHER_LABEL = "math-teacher"
"""The model name the agent asks the gateway for."""


class Decoder(Protocol):
    """Anything that turns ids into text: a Renderer, a FakeEngine, a (HF or `tokenizers`) tokenizer."""

    def decode(self, ids: list[int], *args: Any, **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class Ref:
    """An operand that is the result of an earlier step."""

    step: int


@dataclass(frozen=True)
class Step:
    """One tool call of a solution: `tool(left, right)`."""

    tool: str
    left: int | float | Ref
    right: int | float | Ref


# ---------------------------------------------------------------------------------------------
# Solving: question text -> the tool calls, in the order the teacher makes them.


def plan(expression: str) -> list[Step]:
    """The tool calls that compute `expression` (+ and * over numbers), innermost first."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise InvalidRequest(f"not an arithmetic expression: {expression!r}") from e
    steps: list[Step] = []
    _walk(tree.body, steps, expression)
    return steps


def _walk(node: ast.expr, steps: list[Step], expression: str) -> int | float | Ref:
    """Post-order: both operands are computed (left first) before the operation using them."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in TOOL_NAMES:
        left = _walk(node.left, steps, expression)
        right = _walk(node.right, steps, expression)
        steps.append(Step(TOOL_NAMES[type(node.op)], left, right))
        return Ref(len(steps) - 1)
    raise InvalidRequest(f"the teacher only adds and multiplies numbers: {expression!r}")


def evaluate(expression: str) -> float:
    """The value of `expression`, computed by the same steps the teacher takes."""
    results: list[float] = []
    for step in plan(expression):
        a, b = (_value(x, results) for x in (step.left, step.right))
        results.append(a + b if step.tool == "add" else a * b)
    if results:
        return results[-1]
    value = ast.literal_eval(expression.strip())  # a bare number: nothing to call
    return float(value)


def _value(operand: int | float | Ref, results: Sequence[float]) -> float:
    return float(results[operand.step]) if isinstance(operand, Ref) else float(operand)


def as_json_number(x: float) -> int | float:
    """`x` as an int when it is integral (tools answer "7.0"; the call should say 7)."""
    return int(x) if float(x).is_integer() else x


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as the template renders it: `json.dumps` spacing, as its `tojson` filter writes."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def answer_text(value: float) -> str:
    """The final reply: the agent's reward reads its last number."""
    return f"The answer is {as_json_number(value)}."


def next_reply(prompt: str) -> str:
    """The teacher's next assistant turn for a rendered ChatML prompt (special tokens kept)."""
    question, after = _last_question(prompt)
    match = QUESTION.search(question)
    if match is None:
        raise InvalidRequest(f"no 'What is ...?' question in the last user turn: {question!r}")
    steps = plan(match.group(1))
    results = [float(r) for r in TOOL_RESPONSE.findall(after)]
    if not steps:
        return answer_text(evaluate(match.group(1)))
    if len(results) < len(steps):
        step = steps[len(results)]
        a, b = (as_json_number(_value(x, results)) for x in (step.left, step.right))
        return tool_call_text(step.tool, {"a": a, "b": b})
    return answer_text(results[len(steps) - 1])


def _last_question(prompt: str) -> tuple[str, str]:
    """(content of the last user turn that is not tool responses, the prompt text after it)."""
    turns = prompt.split(TURN_START)
    for i in range(len(turns) - 1, 0, -1):
        role, _, content = turns[i].partition("\n")
        if role == "user" and not content.startswith("<tool_response>"):
            return content.split(TURN_END)[0], TURN_START.join(turns[i + 1:])
    raise InvalidRequest("the prompt holds no user question (were special tokens decoded?)")


def teacher_script(decoder: Decoder | str) -> Callable[[GenerateRequest], str]:
    """A FakeEngine script answering each request with the teacher's next step.

    `decoder` decodes prompt ids with special tokens kept: a Renderer, a FakeEngine, a
    tokenizer (asked for `skip_special_tokens=False`), or a model directory to load one from.
    """
    decode = _decode_fn(decoder)

    def reply(request: GenerateRequest) -> str:
        return next_reply(decode(list(request.prompt_ids)))

    return reply


def _decode_fn(decoder: Decoder | str) -> Callable[[list[int]], str]:
    if isinstance(decoder, str):
        from tokenizers import Tokenizer

        from relayrl.models import model_path

        decoder = Tokenizer.from_file(str(Path(model_path(decoder)) / "tokenizer.json"))
    try:
        keeps = "skip_special_tokens" in inspect.signature(decoder.decode).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the plain call
        keeps = False
    if keeps:  # tokenizers drop <|im_start|> by default, and the turns are found by it
        return lambda ids: decoder.decode(ids, skip_special_tokens=False)
    return decoder.decode


# ---------------------------------------------------------------------------------------------
# Traces: the real agent through a real gateway, the teacher as its engine.


async def agenerate_traces(model_dir: str, tasks: Sequence[dict[str, Any]], n: int,
                           out_path: str | Path | None = None,
                           concurrency: int = 4) -> list[dict[str, Any]]:
    """`n` teacher episodes (tasks taken in turn) as concat rows; see `generate_traces`."""
    from relayrl.client import SessionClient
    from relayrl.engine.fake import FakeEngine
    from relayrl.gateway.config import GatewayConfig
    from relayrl.gateway.server import GatewayThread, build_deps
    from relayrl.models import model_path
    from relayrl.workflow import AgentWorkflow, EpisodeContext, episode_scope

    if n < 0 or (n > 0 and not tasks) or concurrency < 1:
        raise InvalidRequest(f"need n >= 0, some tasks and concurrency >= 1; got {n}, "
                             f"{len(tasks)} tasks, {concurrency}")
    path = model_path(model_dir)
    engine = FakeEngine(teacher_script(path), tokenizer_path=path)
    admin_key = secrets.token_hex(16)
    # one version, no trainer: room for all n episodes at once
    config = GatewayConfig(model=path, engine="fake", admin_key=admin_key,
                           model_label=TEACHER_LABEL, batch_size=max(n, 1), max_staleness=0)
    agent = _math_agent_class()(model=TEACHER_LABEL)
    gate = asyncio.Semaphore(concurrency)

    async def episode(i: int, workflow: AgentWorkflow) -> dict[str, Any]:
        task = tasks[i % len(tasks)]
        async with gate:
            with episode_scope(EpisodeContext(task_id=f"teacher-{i}", episode_id=f"teacher-{i}")):
                rows = await workflow.arun_episode(engine, task)
        return _checked_row(i, task, list((rows or {}).values()))

    with GatewayThread(build_deps(config, engine=engine)) as gateway:
        async with SessionClient(gateway.url, admin_key) as client:
            workflow = AgentWorkflow(agent, client)
            try:
                rows = await asyncio.gather(*(episode(i, workflow) for i in range(n)))
            finally:
                await workflow.aclose()
    if out_path is not None:
        from relayrl.trajectory import row_from_dict, write_jsonl

        write_jsonl((row_from_dict(r) for r in rows), out_path)
    return list(rows)


def generate_traces(model_dir: str, tasks: Sequence[dict[str, Any]], n: int,
                    out_path: str | Path | None = None,
                    concurrency: int = 4) -> list[dict[str, Any]]:
    """`n` teacher episodes of the real MathAgent through a loopback gateway, one concat row each.

    Rows are `row_to_dict` records (`input_ids`, `loss_mask`, `turn_spans`, `reward`, ...), every
    one rewarded 1.0 by the agent; written as JSONL to `out_path` when given. Tasks are used in
    turn (cycling when `n` exceeds them). Not for a running event loop: await
    `agenerate_traces` there.
    """
    return asyncio.run(agenerate_traces(model_dir, tasks, n, out_path, concurrency))


def _math_agent_class() -> type:
    """`agent.MathAgent`, importable by that path (as the rollout workers import it)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    from agent import MathAgent

    return MathAgent


def _checked_row(i: int, task: dict[str, Any], rows: list[Any]) -> dict[str, Any]:
    """The episode's only row, as a dict; a teacher episode that is not one rewarded row fails."""
    from relayrl.trajectory import row_to_dict

    question = task["messages"][-1]["content"]
    if len(rows) != 1:
        raise EpisodeFailed(f"teacher episode {i} ({question!r}) exported {len(rows)} rows, "
                            "expected one concat row")
    (row,) = rows
    if row.reward != 1.0:
        raise EpisodeFailed(f"teacher episode {i} ({question!r}) was rewarded {row.reward}")
    return row_to_dict(row)


def main(argv: list[str] | None = None) -> None:
    """Generate traces from a task file; print their size and how long they took."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="packaged name or HF dir")
    p.add_argument("--tasks", default=str(HERE / "train.jsonl"), help="JSONL: messages, answer")
    p.add_argument("--n", type=int, default=128, help="traces to generate")
    p.add_argument("--out", default=None, help="write the rows here (JSONL)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes at once")
    args = p.parse_args(argv)
    with open(args.tasks, encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    start = time.perf_counter()
    rows = generate_traces(args.model, tasks, args.n, args.out, args.concurrency)
    elapsed = time.perf_counter() - start
    lengths = [len(r["input_ids"]) for r in rows]
    trained = [sum(r["loss_mask"]) for r in rows]
    print(f"{len(rows)} traces in {elapsed:.1f} s, all rewarded 1.0; tokens per trace: mean "
          f"{sum(lengths) / max(len(rows), 1):.0f}, max {max(lengths, default=0)}; trained "
          f"tokens per trace: mean {sum(trained) / max(len(rows), 1):.0f}")


if __name__ == "__main__":
    main()
