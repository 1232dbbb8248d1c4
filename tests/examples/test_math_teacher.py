"""The math example's task generator and teacher: questions, oracle replies, and SFT traces.

The traces come from the real MathAgent (openai-agents over HTTP) through a real gateway on
loopback whose engine is a FakeEngine scripted by the teacher.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from relayrl.chat.conversation import Conversation, Message, Tool, ToolCall
from relayrl.chat.renderer import Renderer
from relayrl.errors import ConfigError, InvalidRequest
from relayrl.trajectory import read_jsonl
from tests.examples import load_example

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math_agent"


tasks = load_example("math_agent", "tasks")
teacher = load_example("math_agent", "teacher")


def _jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / name).read_text().splitlines() if line]


def _expression(task: dict) -> str:
    match = teacher.QUESTION.search(task["messages"][-1]["content"])
    assert match is not None
    return match.group(1)


def _canonical(node: ast.expr) -> str:
    """Equal for expressions that differ only in the order of commutative operands."""
    if isinstance(node, ast.Constant):
        return str(node.value)
    assert isinstance(node, ast.BinOp)
    op = type(node.op)

    def flat(n: ast.expr) -> list[str]:
        if isinstance(n, ast.BinOp) and type(n.op) is op:
            return flat(n.left) + flat(n.right)
        return [_canonical(n)]

    return f"{op.__name__}({','.join(sorted(flat(node)))})"


def _key(task: dict) -> str:
    return _canonical(ast.parse(_expression(task), mode="eval").body)


def _form(task: dict) -> str:
    """The question's shape with the numbers blanked out."""
    return re.sub(r"\d+", "n", _expression(task))


# ---------------------------------------------------------------------------------------------
# Tasks


def test_the_generator_is_deterministic_per_seed_and_cycles_through_every_form() -> None:
    first, again = tasks.generate_tasks(60, seed=3), tasks.generate_tasks(60, seed=3)
    assert first == again
    assert first != tasks.generate_tasks(60, seed=4)
    shapes = [_form(t) for t in first]
    assert len(set(shapes)) == len(tasks.FORMS) == 6
    assert all(shapes.count(s) == 10 for s in set(shapes))
    assert all(t["messages"][0]["role"] == "user" and len(t["messages"]) == 1 for t in first)
    operands = [int(x) for t in first for x in re.findall(r"\d+", _expression(t))]
    assert min(operands) >= tasks.LOW and max(operands) <= tasks.HIGH


def test_committed_files_are_the_generators_output_and_eval_is_held_out() -> None:
    train, held_out = _jsonl("train.jsonl"), _jsonl("eval.jsonl")
    assert (train, held_out) == tuple(tasks.split_tasks(256, 48, seed=0))
    assert len(train) == 256 and len(held_out) == 48
    # disjoint even up to reordering commutative operands, and no duplicates within a file
    train_keys, eval_keys = {_key(t) for t in train}, {_key(t) for t in held_out}
    assert len(train_keys) == len(train) and len(eval_keys) == len(held_out)
    assert not train_keys & eval_keys
    assert {_form(t) for t in held_out} == {_form(t) for t in train}


def test_a_balanced_train_mix_keeps_the_eval_set_and_draws_one_call_forms_half_the_time() -> None:
    train, held_out = tasks.split_tasks(256, 48, seed=0, train_mix="balanced")
    assert held_out == _jsonl("eval.jsonl")
    one_call = sum(t["form"] in ("add", "multiply") for t in train)
    assert one_call == len(train) // 2 == 128
    assert {t["form"] for t in train} == {f.name for f in tasks.FORMS}
    assert not {_key(t) for t in train} & {_key(t) for t in held_out}
    assert len({_key(t) for t in train}) == len(train)
    with pytest.raises(ConfigError, match="unknown train mix"):
        tasks.split_tasks(8, 8, train_mix="heavy")


def test_every_answer_agrees_with_the_teachers_own_computation() -> None:
    everything = _jsonl("train.jsonl") + _jsonl("eval.jsonl") + _jsonl("math.jsonl")
    for task in everything:
        assert teacher.evaluate(_expression(task)) == float(task["answer"]), task


# ---------------------------------------------------------------------------------------------
# The teacher's replies


def test_the_teacher_computes_the_inner_operation_first_then_uses_its_result() -> None:
    steps = teacher.plan("(3 + 4) * 5")
    assert steps == [teacher.Step("add", 3, 4), teacher.Step("multiply", teacher.Ref(0), 5)]
    # precedence and several inner results: both products before the sum
    steps = teacher.plan("13 * 3 + 14 * 2")
    assert [s.tool for s in steps] == ["multiply", "multiply", "add"]
    assert steps[2] == teacher.Step("add", teacher.Ref(0), teacher.Ref(1))


def _prompt(renderer: Renderer, question: str, results: list[str]) -> str:
    messages = [Message(role="user", content=question)]
    for i, result in enumerate(results):
        call = ToolCall(id=f"call_{i}", name="add", arguments='{"a":1,"b":2}')
        messages += [Message(role="assistant", content="", tool_calls=(call,)),
                     Message(role="tool", content=result, tool_call_id=f"call_{i}")]
    return renderer.render_text(Conversation(tuple(messages), (Tool(name="add"),)))


def test_the_teacher_reads_tool_results_from_the_prompt_and_writes_ints_when_integral(
        model_dir: str) -> None:
    renderer = Renderer.from_pretrained(model_dir)
    question = "What is (2 + 5) * 3? Use the add and multiply tools, then give the final number."
    assert teacher.next_reply(_prompt(renderer, question, [])) == teacher.tool_call_text(
        "add", {"a": 2, "b": 5})
    reply = teacher.next_reply(_prompt(renderer, question, ["7.0"]))
    assert reply == teacher.tool_call_text("multiply", {"a": 7, "b": 3})
    assert '"a": 7,' in reply  # "7.0" from the tool is called back as the integer 7
    assert teacher.next_reply(_prompt(renderer, question, ["7.5"])).count('"a": 7.5') == 1
    assert teacher.next_reply(_prompt(renderer, question, ["7.0", "21.0"])) == "The answer is 21."


def test_the_teacher_refuses_a_question_it_cannot_solve(model_dir: str) -> None:
    renderer = Renderer.from_pretrained(model_dir)
    for question in ("Tell me a joke.", "What is 7 - 2? Use the tools."):
        with pytest.raises(InvalidRequest):
            teacher.next_reply(_prompt(renderer, question, []))


def test_tool_calls_are_spelled_as_the_template_renders_them(model_dir: str) -> None:
    renderer = Renderer.from_pretrained(model_dir)
    # the gateway stores a parsed call's arguments as compact JSON; the template re-renders them
    call = ToolCall(id="call_0", name="multiply", arguments='{"a":24,"b":15}')
    conv = Conversation((Message(role="user", content="hi"),
                         Message(role="assistant", content="", tool_calls=(call,))),
                        (Tool(name="multiply"),))
    rendered = renderer.render_text(conv, add_generation_prompt=False)
    assert teacher.tool_call_text("multiply", {"a": 24, "b": 15}) + "<|im_end|>" in rendered


# ---------------------------------------------------------------------------------------------
# Traces through the real agent and gateway


def _two_of_each_form() -> list[dict]:
    by_form: dict[str, list[dict]] = {}
    for task in tasks.generate_tasks(24, seed=11):
        by_form.setdefault(_form(task), []).append(task)
    return [t for group in by_form.values() for t in group[:2]]


def test_the_teacher_solves_every_form_through_the_agent_and_gateway(
        model_dir: str, tmp_path: Path) -> None:
    chosen = _two_of_each_form() + _jsonl("math.jsonl")[8:11]  # and a three-call question
    out = tmp_path / "traces.jsonl"
    rows = teacher.generate_traces(model_dir, chosen, len(chosen), out_path=out, concurrency=3)
    assert len(rows) == len(chosen) == 15
    assert all(r["reward"] == 1.0 and r["style"] == "concat" for r in rows)
    steps = [len(teacher.plan(_expression(t))) for t in chosen]
    assert [len(r["turn_spans"]) for r in rows] == [n + 1 for n in steps]  # calls + the answer
    assert {1, 2, 3} <= set(steps)
    written = read_jsonl(out)
    assert [w.input_ids for w in written] == [r["input_ids"] for r in rows]


async def test_a_trace_is_one_concat_row_that_trains_on_the_calls_and_the_answer(
        model_dir: str) -> None:
    form = next(f for f in tasks.FORMS if f.name == "add_then_multiply")
    task = tasks.make_task(form, 3, 4, 5)  # (3 + 4) * 5
    (row,) = await teacher.agenerate_traces(model_dir, [task], 1)
    renderer = Renderer.from_pretrained(model_dir)
    ids, mask = row["input_ids"], row["loss_mask"]
    spans = [ids[s:e] for s, e in row["turn_spans"]]
    trained = [renderer.decode(span) for span in spans]
    assert trained == [teacher.tool_call_text("add", {"a": 3, "b": 4}) + "<|im_end|>",
                       teacher.tool_call_text("multiply", {"a": 7, "b": 5}) + "<|im_end|>",
                       "The answer is 35.<|im_end|>"]
    assert [i for i, m in enumerate(mask) if m] == [i for s, e in row["turn_spans"]
                                                    for i in range(s, e)]
    # the tokens are those of a full render of the finished conversation (tools as sent)
    prompt = renderer.decode(ids)
    tool_lines = prompt.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    tools = tuple(Tool(name=f["name"], description=f["description"], parameters=f["parameters"])
                  for f in (json.loads(line)["function"] for line in tool_lines))
    system = prompt.split("<|im_start|>system\n")[1].split("\n\n# Tools")[0]
    calls = [ToolCall(id="call_0", name="add", arguments='{"a":3,"b":4}'),
             ToolCall(id="call_1", name="multiply", arguments='{"a":7,"b":5}')]
    (question,) = task["messages"]
    messages = [Message(role="system", content=system),
                Message(role="user", content=question["content"])]
    for call, result in zip(calls, ["7.0", "35.0"], strict=True):
        messages += [Message(role="assistant", content="", tool_calls=(call,)),
                     Message(role="tool", content=result, tool_call_id=call.id)]
    messages.append(Message(role="assistant", content="The answer is 35."))
    full = renderer.render(Conversation(tuple(messages), tools), add_generation_prompt=False)
    assert full[:len(ids)] == ids and renderer.decode(full[len(ids):]) == "\n"
