"""relayrl.envs.reasoning_gym with the real reasoning-gym package: items, errors, scoring, curriculum.

The episodes run the real agent (the openai SDK) against a real gateway on loopback whose engine
is scripted (FakeEngine), so the replies, and therefore the scores, are known; the training run
with the real model is in tests/examples/test_reasoning_gym_example.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install "
                    "'relayrl[reasoning-gym]')")

from relayrl.envs import reasoning_gym as rgenv
from relayrl.errors import ConfigError
from relayrl.workflow import (
    EpisodeStatus,
    episode_scope,
    resolve_workflow,
    run_episode,
)
from tests.episodes import episode_ctx

ADD = {"min_terms": 2, "max_terms": 2, "max_digits": 1, "operators": ["+"],
       "allow_parentheses": False, "allow_negation": False}
AGENT = "relayrl.envs.reasoning_gym:ReasoningGymAgent"


def test_an_unknown_dataset_names_the_close_ones() -> None:
    with pytest.raises(ConfigError, match=r"no dataset .leg_countin.*leg_counting"):
        rgenv.make_items("leg_countin", size=2, seed=1)


def test_bad_settings_list_the_datasets_own_settings() -> None:
    with pytest.raises(ConfigError, match=r"does not take config \['max_term'\].*'max_terms'"):
        rgenv.make_items("basic_arithmetic", size=2, seed=1, config={"max_term": 3})
    with pytest.raises(ConfigError, match="refused config"):
        rgenv.make_items("basic_arithmetic", size=2, seed=1, config={"min_terms": 0})
    with pytest.raises(ConfigError, match="give seed on its own"):
        rgenv.make_items("basic_arithmetic", size=2, seed=1, config={"seed": 3})


def test_items_are_reproducible_and_another_seed_holds_other_questions() -> None:
    train = rgenv.make_items("basic_arithmetic", size=32, seed=1, config=ADD)
    assert train == rgenv.make_items("basic_arithmetic", size=32, seed=1, config=ADD)
    held_out = rgenv.make_items("basic_arithmetic", size=32, seed=2, config=ADD)
    assert [i["question"] for i in train] != [i["question"] for i in held_out]
    agent = rgenv.ReasoningGymAgent()
    for item in train[:4]:
        q = agent.question(item)  # regenerated from the package: the same entry
        assert (q.entry["question"], q.entry["answer"]) == (item["question"], item["answer"])
        assert q.entry["metadata"]["source_dataset"] == "basic_arithmetic"


def test_reasoning_gyms_answer_extraction_and_system_prompts() -> None:
    assert rgenv.extract_answer("so <answer>1</answer> no, <answer> 7 </answer>") == "7"
    assert rgenv.extract_answer("7") is None
    assert rgenv.extract_answer("  7 \n", tag=None) == "7"
    assert "<answer>" in (rgenv.system_prompt_text("default") or "")
    assert rgenv.system_prompt_text("Answer briefly.") == "Answer briefly."
    with pytest.raises(ConfigError, match="neither one of reasoning-gym's"):
        rgenv.system_prompt_text("defualt")


async def test_an_episode_is_scored_by_the_datasets_own_score_answer(gw, client) -> None:
    item = rgenv.make_items("basic_arithmetic", size=1, seed=1, config=ADD)[0]
    answer = item["answer"]
    workflow = resolve_workflow(AGENT, {"max_tokens": 16}, group_size=3, gateway=client)
    # reasoning-gym's convention: the last <answer> tag; no tag is no answer (score 0)
    gw.script.replies.extend([f"<answer>{answer}</answer>", f"It is {answer}", "<answer>x</answer>"])
    out = await run_episode(workflow, None, item, episode_ctx())
    assert out.status == EpisodeStatus.FINISHED, out.error
    assert sorted(out.rows.rows[i].reward for i in range(3)) == [0.0, 0.0, 1.0]
    # the policy saw reasoning-gym's default system prompt and the dataset's question
    prompt = gw.thread.deps.engine.tokenizer.decode(gw.script.requests[-1].prompt_ids)
    assert "<answer>answer here</answer>" in prompt and item["question"] in prompt
    counters = workflow.counters()
    assert counters["episodes"] == 3 and counters["answer_rate"] == pytest.approx(2 / 3)


async def test_with_answer_tag_none_the_whole_reply_is_scored(gw, client) -> None:
    item = rgenv.make_items("basic_arithmetic", size=1, seed=1, config=ADD)[0]
    answer = item["answer"]
    workflow = resolve_workflow(AGENT, {"answer_tag": None, "system_prompt": None},
                                gateway=client)
    gw.script.replies.append(f"It is {answer}")
    out = await run_episode(workflow, None, item, episode_ctx())
    # the base class's score_answer: partial credit len(answer) / len(reply) when it contains it
    assert out.rows.rows[0].reward == pytest.approx(len(answer) / len(f"It is {answer}"))


async def test_an_entry_reasoning_gym_wrote_itself_is_accepted(gw, client) -> None:
    import reasoning_gym

    entry = reasoning_gym.create_dataset("leg_counting", seed=3, size=1)[0]
    plain = {"question": entry["question"], "answer": entry["answer"],
             "metadata": {"source_dataset": "leg_counting"}}
    workflow = resolve_workflow(AGENT, {}, gateway=client)
    gw.script.replies.append(f"<answer>{entry['answer']}</answer>")
    out = await run_episode(workflow, None, plain, episode_ctx())
    assert out.rows.rows[0].reward == 1.0
    out = await run_episode(workflow, None, {"messages": []}, episode_ctx(1))
    assert out.status == EpisodeStatus.ABORTED and "metadata.source_dataset" in out.error


def test_the_curriculum_moves_on_its_window_and_only_on_its_current_level() -> None:
    settings = rgenv.CurriculumSettings(window=4, raise_at=0.75, lower_at=0.25)
    c = rgenv.Curriculum("chain_sum", settings)
    assert c.level == 0
    for score in (1.0, 1.0, 1.0, 0.0):
        c.record(score, 0)
    assert c.level == 1 and c.changes == 1
    c.record(0.0, 0)  # played at the old level: ignored
    assert len(c.scores) == 0
    assert c.config(1, {})["max_terms"] > c.config(0, {})["max_terms"]
    for _ in range(4):
        c.record(0.0, 1)
    assert c.level == 0 and c.changes == 2
    with pytest.raises(ConfigError, match="no curriculum for 'gsm_symbolic'"):
        rgenv.Curriculum("gsm_symbolic", settings)
    with pytest.raises(ConfigError, match="lower_at < raise_at"):
        rgenv.CurriculumSettings(raise_at=0.5, lower_at=0.6)


async def test_a_group_plays_one_level_and_held_out_episodes_keep_the_items_settings(
        gw, client) -> None:
    item = rgenv.make_items("chain_sum", size=4, seed=1)[2]
    agent = rgenv.ReasoningGymAgent(curriculum={"window": 1, "raise_at": 0.5})
    workflow = resolve_workflow(agent, gateway=client)
    with episode_scope(episode_ctx(0, group="g1")):
        at_zero = agent.question(item)  # the group's first episode pins level 0
    assert at_zero.level == 0
    gw.script.replies.append(f"<answer>{at_zero.entry['answer']}</answer>")
    out = await run_episode(workflow, None, item, episode_ctx(1, group="g1"))
    assert out.rows.rows[0].reward == 1.0
    assert workflow.counters()["chain_sum_level"] == 1  # a full window at 1.0 raised it
    with episode_scope(episode_ctx(2, group="g1")):  # the rest of the group: the same question
        assert agent.question(item).entry == at_zero.entry
    with episode_scope(episode_ctx(0, group="g2")):
        harder = agent.question(item)
    assert harder.level == 1
    difficulty = harder.entry["metadata"]["difficulty"]  # the settings the entry was made with
    assert difficulty["num_terms"] == (2, 3) and at_zero.entry["metadata"]["difficulty"][
        "num_terms"] == (2, 2)
    with episode_scope(episode_ctx(0, group="g3", is_eval=True)):
        held_out = agent.question(item)
    assert held_out.level is None and held_out.entry["question"] == item["question"]


def test_an_answer_pattern_takes_its_last_match_before_any_tag() -> None:
    assert rgenv.extract_answer("4 + 2 = 6.", pattern=rgenv.LAST_NUMBER) == "6"
    assert rgenv.extract_answer("<answer>7</answer> so 3 - 5 = -2", pattern=rgenv.LAST_NUMBER) == "-2"
    assert rgenv.extract_answer("no digits here", pattern=rgenv.LAST_NUMBER) is None
    assert rgenv.extract_answer("it is 4, it is 12 apples", pattern=r"it is (\d+)") == "12"
    with pytest.raises(ConfigError, match="not a regular expression"):
        rgenv.ReasoningGymAgent(answer_pattern="(\\d+")


async def test_with_an_answer_pattern_the_last_number_is_scored_exactly(gw, client) -> None:
    item = rgenv.make_items("basic_arithmetic", size=1, seed=1, config=ADD)[0]
    answer = int(item["answer"])
    workflow = resolve_workflow(AGENT, {"answer_pattern": rgenv.LAST_NUMBER,
                                        "system_prompt": None}, group_size=3, gateway=client)
    gw.script.replies.extend([f"{item['question'][10:-1]} = {answer}.",
                              f"It is {answer + 1}", "I cannot say"])
    out = await run_episode(workflow, None, item, episode_ctx())
    assert out.status == EpisodeStatus.FINISHED, out.error
    # score_answer of the extracted number: the sum itself 1.0, another number 0, none 0
    assert sorted(out.rows.rows[i].reward for i in range(3)) == [0.0, 0.0, 1.0]
    counters = workflow.counters()
    assert counters["answer_rate"] == pytest.approx(2 / 3)
    assert counters["full_score_rate"] == pytest.approx(1 / 3)
