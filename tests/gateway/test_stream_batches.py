"""How the streamed path batches what the engine made ready: consecutive chunks of one choice
become one chunk, in order, and nothing crosses a choice, a finish or an error."""

from __future__ import annotations

from relayrl.gateway.core import _merge_ready
from relayrl.types import FinishReason, TokenChunk, TopLogprob


def chunk(*ids: int, finish: FinishReason | None = None, tops: bool = False) -> TokenChunk:
    return TokenChunk(ids=list(ids), logprobs=[-float(i) for i in ids], versions=[7] * len(ids),
                      top_logprobs=[[TopLogprob(i, -float(i))] for i in ids] if tops else None,
                      finish_reason=finish, stop_string="x" if finish else None)


def test_a_run_of_one_choice_becomes_one_chunk_with_its_last_finish() -> None:
    merged = _merge_ready([(0, chunk(1)), (0, chunk(2, 3)), (0, chunk(4, finish=FinishReason.STOP)),
                           (0, None)])
    assert [i for i, _ in merged] == [0, 0]
    first = merged[0][1]
    assert isinstance(first, TokenChunk)
    assert (first.ids, first.logprobs, first.versions) == ([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0],
                                                           [7, 7, 7, 7])
    assert (first.finish_reason, first.stop_string) == (FinishReason.STOP, "x")
    assert merged[1] == (0, None)


def test_choices_errors_finishes_and_top_logprob_changes_split_runs() -> None:
    error = RuntimeError("engine failed")
    items = [(0, chunk(1)), (1, chunk(10)), (1, chunk(11)), (0, chunk(2)), (0, error),
             (0, chunk(3, finish=FinishReason.LENGTH)), (0, chunk(4)), (1, chunk(12, tops=True)),
             (1, chunk(13, tops=True)), (1, chunk(14))]
    merged = _merge_ready(items)
    shapes = [(i, c.ids if isinstance(c, TokenChunk) else c) for i, c in merged]
    assert shapes == [(0, [1]), (1, [10, 11]), (0, [2]), (0, error), (0, [3]), (0, [4]),
                      (1, [12, 13]), (1, [14])]
    tops = merged[6][1]
    assert isinstance(tops, TokenChunk) and tops.top_logprobs == [[TopLogprob(12, -12.0)],
                                                                  [TopLogprob(13, -13.0)]]
    single = items[0][1]
    assert merged[0][1] is single  # a run of one is passed on as it is
