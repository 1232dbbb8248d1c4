"""TextArena self-play: real games from the textarena package, both seats through the gateway.

The wiring tests script the policy's moves with the fake engine (tests/gateway/conftest.py), so
the game's outcome is known: who won, who lost by invalid moves. The end-to-end test trains the
real default model on TicTacToe with `relayrl train` (marked slow).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("textarena", reason="textarena is not installed (pip install "
                    "'relayrl[textarena]')")

from relayrl.client.session_client import SessionClient
from relayrl.envs import textarena as taenv
from relayrl.errors import ConfigError
from relayrl.rollout import RolloutConfig, RolloutController
from relayrl.workflow import (
    EpisodeResult,
    RolloutWorkflow,
    episode_scope,
    resolve_workflow,
)
from tests.episodes import episode_ctx
from tests.gateway.conftest import Gateway

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = "relayrl.envs.textarena:TextArenaWorkflow"
# TicTacToe: player 0 takes the top row while player 1 plays the middle one
P0_WINS = ["[0]", "[3]", "[1]", "[4]", "[2]"]


def _by_role(rows: dict) -> dict[str, list]:
    out: dict[str, list] = {}
    for row in rows.values():
        out.setdefault(row.metadata["session"]["role"], []).append(row)
    return out


async def test_the_winner_gets_1_and_the_loser_minus_1_each_in_its_own_session(
        gw: Gateway, client: SessionClient) -> None:
    gw.script.replies.extend(P0_WINS)
    wf = resolve_workflow(WORKFLOW, {"max_tokens": 8}, gateway=client)
    try:
        with episode_scope(episode_ctx()):
            rows = await wf.arun_episode(None, {"env_id": "TicTacToe-v0", "seed": 1})
    finally:
        await wf.aclose()
    seats = _by_role(rows)
    assert sorted(seats) == ["player_0", "player_1"]
    assert {r.reward for r in seats["player_0"]} == {1.0}
    assert {r.reward for r in seats["player_1"]} == {-1.0}
    # two sessions, two episodes, two groups (one per seat): never normalised against each other
    for role, seat_rows in seats.items():
        assert len({r.session_id for r in seat_rows}) == 1
        assert {r.metadata["session"]["episode_id"] for r in seat_rows} == {f"ep-grp-1-0:{role}"}
        assert {r.metadata["session"]["group_id"] for r in seat_rows} == {f"grp-1:{role}"}
    assert seats["player_0"][0].session_id != seats["player_1"][0].session_id
    # the moves went through the gateway in turn order, each seat seeing the game's prompt
    assert len(gw.script.requests) == 5
    assert wf.counters()["games"] == 1


async def test_group_by_role_false_keeps_both_seats_in_the_items_group(
        gw: Gateway, client: SessionClient) -> None:
    gw.script.replies.extend(P0_WINS)
    wf = resolve_workflow(WORKFLOW, {"group_by_role": False}, gateway=client)
    try:
        with episode_scope(episode_ctx(group="grp-3")):
            rows = await wf.arun_episode(None, {"env_id": "TicTacToe-v0", "seed": 3})
    finally:
        await wf.aclose()
    seats = _by_role(rows)
    assert {r.metadata["session"]["group_id"] for s in seats.values()
            for r in s} == {"grp-3:seats"}
    assert sum(r.reward for s in seats.values() for r in s[:1]) == 0.0  # zero-sum: +1 and -1


async def test_invalid_moves_are_the_games_business(gw: Gateway, client: SessionClient) -> None:
    # TicTacToe allows one invalid move, then the seat loses; player 1 never moves
    gw.script.replies.extend(["I pick the middle", "still no move"])
    wf = resolve_workflow(WORKFLOW, {"env_id": "TicTacToe-v0"}, gateway=client)
    try:
        with episode_scope(episode_ctx(group="grp-2")):
            rows = await wf.arun_episode(None, {"seed": 2})
    finally:
        await wf.aclose()
    seats = _by_role(rows)
    assert list(seats) == ["player_0"]  # a seat with no calls leaves no rows
    assert {r.reward for r in seats["player_0"]} == {-1.0}
    assert wf.counters()["invalid_move_losses"] == 1
    assert len(gw.script.requests) == 2  # the game let the seat retry once
    # the retry was asked with the game's own warning about the first move in the prompt
    retry = gw.thread.deps.engine.tokenizer.decode(list(gw.script.requests[1].prompt_ids))
    assert "attempted an invalid move" in retry
    open_sessions = await client.list_sessions("open")
    assert not open_sessions  # player 1's unused session was released


async def test_a_group_trains_each_seat_against_the_same_seat(
        gw: Gateway, client: SessionClient) -> None:
    # two games of one item: player 0 wins the first, player 1 the second
    p1_wins = ["[0]", "[3]", "[1]", "[4]", "[8]", "[5]"]
    gw.script.replies.extend(P0_WINS + p1_wins)
    wf = resolve_workflow(WORKFLOW, {"max_tokens": 8}, gateway=client)
    cfg = RolloutConfig(group_size=2, batch_size=1, max_concurrent_rollouts=2, progress=False,
                        epochs=1, shuffle=False)
    items = [{"env_id": "TicTacToe-v0", "seed": 7}]
    ctl = RolloutController(_Sequential(wf), items, cfg)
    try:
        batch = await ctl.next_batch()
    finally:
        await ctl.aclose()
    rewards: dict[str, list[float]] = {}
    for group, episode, reward in zip(batch.group_ids, batch.episode_ids, batch.rows.rewards,
                                      strict=True):
        rewards.setdefault(group, []).append((episode, reward))
    assert len(rewards) == 2 and all(g.endswith((":player_0", ":player_1")) for g in rewards)
    per_group = {g.rsplit(":", 1)[1]: sorted({r for _, r in v}) for g, v in rewards.items()}
    assert per_group == {"player_0": [-1.0, 1.0], "player_1": [-1.0, 1.0]}
    assert len(set(batch.episode_ids)) == 4  # two games, two seats each


class _Sequential(RolloutWorkflow):
    """Runs the wrapped workflow's episodes one at a time, so each game gets the scripted moves
    written for it (the fake engine's script is shared)."""

    def __init__(self, inner: RolloutWorkflow) -> None:
        self.inner = inner
        self.lock = asyncio.Lock()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> EpisodeResult:
        async with self.lock:
            return await self.inner.arun_episode(engine, data)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_an_unknown_game_names_the_close_ones() -> None:
    with pytest.raises(ConfigError, match=r"no game 'TicTacToe-v9'.*TicTacToe-v0"):
        taenv.make_items("TicTacToe-v9", episodes=2)


async def test_the_workflow_refuses_an_unknown_game_before_any_episode(
        client: SessionClient) -> None:
    with pytest.raises(ConfigError, match=r"ConnectFour-v0"):
        resolve_workflow(WORKFLOW, {"env_id": "ConectFour-v0"}, gateway=client)
    with pytest.raises(ConfigError, match="opens gateway sessions"):
        resolve_workflow(WORKFLOW)


def test_a_missing_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "textarena", None)  # import now fails
    with pytest.raises(ImportError, match=r"pip install 'textarena"):
        taenv.make_items("TicTacToe-v0", episodes=1)


def test_the_command_writes_items_and_refuses_unknown_games(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "relayrl.envs.textarena", "TicTacToe-v0",
                           "--episodes", "3", "--seed", "10"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    items = [json.loads(x) for x in proc.stdout.splitlines()]
    assert items == [{"env_id": "TicTacToe-v0", "seed": s, "num_players": 2}
                     for s in (10, 11, 12)]
    bad = subprocess.run([sys.executable, "-m", "relayrl.envs.textarena", "TicTacTo-v0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "TicTacToe-v0" in bad.stderr


@pytest.mark.slow
def test_relayrl_train_plays_tictactoe_against_itself_and_trains_each_seat(
        tmp_path: Path) -> None:
    """The real default model, the real gateway and `relayrl train`: two GRPO steps of
    TicTacToe self-play from examples/textarena/config.yaml."""
    dumps = tmp_path / "dumps"
    overrides = [f"fileroot={tmp_path / 'runs'}", "trial_name=ci", "train.total_steps=2",
                 "rollout.group_size=4", "rollout.batch_size=1", "workflow_kwargs.max_tokens=8",
                 f"rollout.dump_root={dumps}",
                 "train.drop_uniform_groups=false"]  # every batch takes a step: 2 exactly
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train",
                           str(ROOT / "examples" / "textarena" / "config.yaml"), *overrides],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "workflow games=8" in proc.stdout  # 2 steps x 1 item x 4 games
    run = tmp_path / "runs" / "textarena" / "ci"
    lines = [json.loads(x) for x in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "step_s" in m] == [1, 2]
    for m in lines:
        if "step_s" in m:  # metrics per seat: player_0 moves first in every game
            assert m["role/player_0/episodes"] >= 1 and "role/player_0/reward_mean" in m
    rows = [json.loads(x) for f in sorted(dumps.rglob("*.jsonl"))
            for x in f.read_text().splitlines()]
    assert rows, "the trained groups were dumped"
    for row in rows:
        role = row["group_id"].rsplit(":", 1)[1]
        assert role in {"player_0", "player_1"} and row["episode_id"].endswith(f":{role}")
        assert row["role"] == role  # the seat, recorded as the row's role (gateway.roles)
        assert row["reward"] in {-1.0, 0.0, 1.0}  # the game's own outcome for the seat
        assert "Tic Tac Toe" in row["prompt"]  # TextArena's own observation
    # a group is one seat's games (its episodes never mix roles), four games at most
    for group in {r["group_id"] for r in rows}:
        episodes = {r["episode_id"] for r in rows if r["group_id"] == group}
        assert 1 <= len(episodes) <= 4
