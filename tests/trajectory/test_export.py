from __future__ import annotations

import pytest
import torch

from relayrl.errors import InvalidRequest, SessionClosed
from relayrl.trajectory import (
    CallTree,
    Session,
    TrajectoryRow,
    export_session,
    to_tensor_dict,
)
from relayrl.types import PROMPT_VERSION

from . import EOT, assistant, call, sys_msg, three_turn_session, user


def _rewarded_session() -> tuple[Session, list]:
    s = Session("s", task_id="task-7", metadata={"split": "train"})
    calls = three_turn_session(s)
    s.set_reward(calls[0].id, 0.1)
    s.set_final_reward(1.0)
    return s, calls


def _trained(row: TrajectoryRow) -> list[tuple[int, float, int]]:
    return [(t, lp, v) for t, m, lp, v in zip(row.input_ids, row.loss_mask, row.logprobs,
                                              row.versions, strict=True) if m]


def test_individual_rows_mask_the_prompt_and_carry_credited_rewards() -> None:
    s, calls = _rewarded_session()
    rows = export_session(s, "individual", credit="discount", discount=0.5)
    assert [r.interaction_ids for r in rows] == [[c.id] for c in calls]
    for row, c in zip(rows, calls, strict=True):
        p = len(c.prompt_ids)
        assert row.input_ids == list(c.prompt_ids + c.output_ids)
        assert row.loss_mask == [0] * p + [1] * len(c.output_ids)
        assert row.logprobs[:p] == [0.0] * p and row.logprobs[p:] == list(c.logprobs)
        assert row.versions[:p] == [PROMPT_VERSION] * p and row.versions[p:] == list(c.versions)
        assert row.turn_spans == [(p, len(row.input_ids))]
        assert row.task_id == "task-7" and row.metadata["session"] == {"split": "train"}
    # leaf gets the final reward 1.0; then 0.5 * 1.0; then own 0.1 + 0.5 * 0.5
    assert [r.reward for r in rows] == pytest.approx([0.35, 0.5, 1.0])


def test_a_linear_session_concats_into_one_contiguous_row() -> None:
    s, calls = _rewarded_session()
    (row,) = export_session(s, "concat", credit="discount", discount=0.5)
    assert row.interaction_ids == [c.id for c in calls]
    assert row.input_ids == list(calls[-1].token_ids)
    assert row.turn_spans == [(len(c.prompt_ids), len(c.token_ids)) for c in calls]
    assert sum(row.loss_mask) == sum(len(c.output_ids) for c in calls)
    # tool results and the user's turn between outputs are glue: never trained on
    start2 = row.turn_spans[1][0]
    assert row.loss_mask[row.turn_spans[0][1]:start2] == [0] * (start2 - row.turn_spans[0][1])
    assert set(row.versions[row.turn_spans[0][1]:start2]) == {PROMPT_VERSION}
    assert row.turn_rewards == pytest.approx([0.35, 0.5, 1.0]) and row.reward == 1.0
    assert row.metadata["branch_reason"] == "first"


def test_concat_and_individual_train_exactly_the_same_sampled_tokens() -> None:
    s, _ = _rewarded_session()
    (concat,) = export_session(s, "concat")
    individual = export_session(s, "individual")
    assert _trained(concat) == [t for r in individual for t in _trained(r)]
    # the weight update between call 1 and 2 shows in the versions of the trained tokens
    assert sorted({v for _, _, v in _trained(concat)}) == [0, 1]


def test_a_branched_segment_gives_one_concat_row_per_leaf() -> None:
    s = Session("s")
    h = [sys_msg(), user("q")]
    root = call(s, h, "a")
    left = call(s, [*h, assistant("a"), user("left")], "l")
    right = call(s, [*h, assistant("a"), user("right")], "r")
    s.set_reward(left.id, 1.0)
    rows = export_session(s, "concat", discount=1.0)
    assert [r.interaction_ids for r in rows] == [[root.id, left.id], [root.id, right.id]]
    assert rows[0].input_ids[: len(root.token_ids)] == rows[1].input_ids[: len(root.token_ids)]
    assert [r.reward for r in rows] == [1.0, 0.0]
    assert rows[0].turn_rewards[0] == rows[1].turn_rewards[0] == pytest.approx(0.5)


def test_an_edited_history_exports_as_its_own_segment_row() -> None:
    s = Session("s")
    three_turn_session(s)
    edited = call(s, [sys_msg(), user("summary"), assistant("noted"), user("go")], "done")
    rows = export_session(s, "concat", credit="outcome")
    assert len(rows) == 2
    assert rows[1].interaction_ids == [edited.id]
    assert rows[1].metadata["branch_reason"] == "history_edited"


def test_export_is_pure_and_idempotent() -> None:
    s, _ = _rewarded_session()
    before = (s.interactions, s.final_reward, s.state, s.stats())
    for style in ("individual", "concat"):
        for credit in ("discount", "outcome", "returns_to_go"):
            assert export_session(s, style, credit, 0.9) == export_session(s, style, credit, 0.9)
    assert (s.interactions, s.final_reward, s.state, s.stats()) == before


def test_aborted_sessions_are_not_exported_unless_asked() -> None:
    s, _ = _rewarded_session()
    s.abort()
    with pytest.raises(SessionClosed):
        export_session(s)
    assert len(export_session(s, "individual", allow_aborted=True)) == 3


def test_unknown_style_or_rule_is_refused_and_custom_rules_are_used() -> None:
    s, _ = _rewarded_session()
    with pytest.raises(InvalidRequest):
        export_session(s, "packed")
    with pytest.raises(InvalidRequest):
        export_session(s, credit="gae")

    def depth(tree: CallTree, gamma: float) -> dict[str, float]:
        return {n: float(len(tree.path_to(n))) for n in tree.order}

    rows = export_session(s, "individual", credit=depth)
    assert [r.reward for r in rows] == [1.0, 2.0, 3.0] and rows[0].metadata["credit"] == "depth"


def test_tensor_dict_is_right_padded_in_the_seed_dtypes() -> None:
    s, calls = _rewarded_session()
    rows = export_session(s, "individual")
    batch = to_tensor_dict(rows)
    lengths = [len(c.token_ids) for c in calls]
    b, t = len(rows), max(lengths)
    assert batch["input_ids"].shape == (b, t) and batch["input_ids"].dtype == torch.int32
    assert batch["attention_mask"].dtype == torch.bool
    assert batch["loss_mask"].dtype == torch.int32 and batch["versions"].dtype == torch.int32
    assert batch["logprobs"].dtype == torch.float32
    assert batch["rewards"].shape == (b,) and batch["rewards"].dtype == torch.float32
    assert batch["attention_mask"].sum(1).tolist() == lengths
    assert batch["input_ids"][0, : lengths[0]].tolist() == rows[0].input_ids
    assert batch["input_ids"][0, lengths[0]:].eq(0).all()
    assert batch["versions"][0, lengths[0]:].eq(PROMPT_VERSION).all()
    assert batch["loss_mask"].sum().item() == sum(sum(r.loss_mask) for r in rows)
    assert batch["input_ids"][1, lengths[1] - 1].item() == EOT
    with pytest.raises(InvalidRequest):
        to_tensor_dict([])


def test_rows_refuse_misaligned_fields() -> None:
    with pytest.raises(ValueError, match="mask"):
        TrajectoryRow("s", None, "g", "individual", ["c"], [1, 2], [0], [0.0, 0.0], [-1, -1],
                      0.0, [(1, 2)], [0.0])
    with pytest.raises(ValueError, match="span"):
        TrajectoryRow("s", None, "g", "individual", ["c"], [1, 2], [0, 1], [0.0, 0.0],
                      [-1, 0], 0.0, [(1, 3)], [0.0])
