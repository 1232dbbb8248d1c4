"""TextArena games as relayrl episodes: every seat played by the policy, each in its own session.

    items = make_items("TicTacToe-v0", episodes=64, seed=0)     # {"env_id", "seed", "num_players"}
    train(cfg, items, workflow="relayrl.envs.textarena:TextArenaWorkflow")

One episode is one game, played the way TextArena's README plays it: `ta.make(env_id)`,
`env.reset(num_players, seed)`, then `player_id, observation = env.get_observation()` and
`env.step(action)` until the game says it is done, and `rewards, game_info = env.close()`. Each
seat is the policy (self-play) answering through its own gateway session with the OpenAI SDK, with
the messages TextArena's own `OpenAIAgent` sends (its standard game prompt as the system message,
the observation as the user message). Invalid moves are the game's business: it warns the seat and
lets it retry, or ends the game against it, as each game's rules say.

Each seat's session is its own episode: its metadata carries `role` (`player_0`, `player_1`, ...)
and its episode id is the game's with the role appended. Its reward is the game's own reward for
that seat (+1 win, -1 loss, 0 draw in the two-player games), set as the session's final reward:
each move is a call of its own (the observation carries the game so far), so the credit rule gives
every move of the seat the game's outcome. By default each seat also gets its own group
(`group_by_role=True`): GRPO compares a seat's play only with the same seat's play in the other
games of the group (same game, same seed), never the winner with the loser of one game; with
`group_by_role=False` both seats share one group (`{group}:seats`), and in a zero-sum game each
group then centres on zero by construction.

The seat is a role (docs/multi-agent.md): the session's metadata `role` is one of the sources the
gateway reads, so with `gateway.roles: true` every call and row of a seat carries its role, the
metrics are per seat (`role/player_0/reward_mean`, ...), and a group that mixes the seats
(`group_by_role=False`) is refused by the trainer instead of being normalised across seats.

May import: `relayrl.workflow`, `relayrl.client`, `relayrl.errors`; textarena and openai only inside
functions (optional extras), never torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import httpx

from relayrl.client.pool import pooled_client
from relayrl.client.session_client import SessionClient, SessionHandle
from relayrl.errors import ConfigError, EpisodeFailed
from relayrl.trajectory import SCHEMA_VERSION, TrajectoryRow, row_from_dict
from relayrl.workflow.agent import AgentConfig
from relayrl.workflow.base import RolloutWorkflow
from relayrl.workflow.context import EpisodeContext
from relayrl.workflow.context import get as current_context
from relayrl.workflow.sessions import SessionReleaser, open_episode_session

PIP_INSTALL = "pip install 'textarena>=0.7.4,<0.8' openai"
"""What to run when TextArena (or the OpenAI SDK its seats talk through) is missing."""


def require() -> ModuleType:
    """The `textarena` package; ImportError with the pip command when it is not installed."""
    try:
        import textarena
    except ImportError as e:
        raise ImportError(f"relayrl.envs.textarena needs the textarena package: {PIP_INSTALL} "
                          "(or pip install 'relayrl[textarena]')") from e
    return textarena


def game_ids() -> list[str]:
    """Every game id TextArena registers, sorted."""
    require()
    from textarena.envs.registration import ENV_REGISTRY

    return sorted(ENV_REGISTRY)


def check_game(env_id: str) -> None:
    """ConfigError naming the closest game ids when TextArena has none called `env_id`."""
    if not isinstance(env_id, str) or not env_id:
        raise ConfigError(f"a TextArena game id is a non-empty string, got {env_id!r}")
    ids = game_ids()
    if env_id in ids:
        return
    close = difflib.get_close_matches(env_id, ids, n=5, cutoff=0.5)
    hint = (f"did you mean {', '.join(close)}?" if close
            else "`python -m relayrl.envs.textarena --list` lists them")
    raise ConfigError(f"TextArena has no game {env_id!r} ({len(ids)} games); {hint}")


def make_items(env_id: str, episodes: int, seed: int = 0,
               num_players: int = 2) -> list[dict[str, Any]]:
    """`episodes` dataset items of one game, seeds `seed`, `seed + 1`, ...; the id is checked."""
    check_game(env_id)
    if episodes < 1 or num_players < 1:
        raise ConfigError(f"need episodes >= 1 and num_players >= 1, got {episodes}, "
                          f"{num_players}")
    return [{"env_id": env_id, "seed": seed + i, "num_players": num_players}
            for i in range(episodes)]


def role_name(player_id: int) -> str:
    """The role a seat's session is recorded under."""
    return f"player_{player_id}"


@dataclass
class _Seat:
    role: str
    session: SessionHandle
    llm: Any
    """The seat's AsyncOpenAI client, bound to its session."""
    calls: int = 0


class TextArenaWorkflow(RolloutWorkflow):
    """Self-play of a TextArena game: one gateway session per seat, rewards from the game."""

    opens_sessions = True
    """Built with the run's `client` and `agent_config` (relayrl.workflow.resolve)."""

    def __init__(self, client: SessionClient, agent_config: AgentConfig | None = None, *,
                 env_id: str | None = None, num_players: int = 2, model: str = "default",
                 max_tokens: int = 64, temperature: float = 1.0,
                 system_prompt: str | None = None, group_by_role: bool = True,
                 max_steps: int = 200) -> None:
        self.ta = require()
        try:
            import openai  # noqa: F401  (the seats' SDK: checked before any episode runs)
        except ImportError as e:
            raise ImportError(f"relayrl.envs.textarena needs the openai package: "
                              f"{PIP_INSTALL}") from e
        if env_id is not None:
            check_game(env_id)
        if num_players < 1 or max_tokens < 1 or max_steps < 1:
            raise ConfigError("need num_players >= 1, max_tokens >= 1 and max_steps >= 1")
        self.client = client
        self.config = agent_config or AgentConfig()
        self.env_id = env_id
        self.num_players = num_players
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        from textarena.agents.basic_agents import STANDARD_GAME_PROMPT

        self.system_prompt = STANDARD_GAME_PROMPT if system_prompt is None else system_prompt
        self.group_by_role = group_by_role
        self.max_steps = max_steps
        self._releaser = SessionReleaser(client)
        self._http: httpx.AsyncClient | None = None
        self._checked: set[str] = set()
        self._counts = {"games": 0.0, "draws": 0.0, "invalid_move_losses": 0.0}

    @property
    def http_client(self) -> httpx.AsyncClient:
        """The HTTP client every seat's OpenAI SDK shares (no connection cap, long timeout)."""
        if self._http is None:
            self._http = pooled_client(self.config.http_timeout_s)
        return self._http

    def _game(self, data: Mapping[str, Any]) -> tuple[str, int | None, int]:
        env_id = data.get("env_id", self.env_id)
        if env_id is None:
            raise ConfigError("the item names no game: give it an `env_id` (or the workflow "
                              "env_id=...)")
        if env_id not in self._checked:
            check_game(env_id)
            self._checked.add(env_id)
        seed = data.get("seed")
        players = int(data.get("num_players", self.num_players))
        return env_id, None if seed is None else int(seed), players

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, TrajectoryRow] | None:
        """Play one game; every seat's rows, each seat labelled with its role and reward."""
        env_id, seed, players = self._game(data)
        env = self.ta.make(env_id)
        env.reset(num_players=players, seed=seed)
        ctx = current_context()
        seats: dict[int, _Seat] = {}
        exported: set[int] = set()
        try:
            for pid in range(players):
                seats[pid] = await self._open_seat(ctx, pid, env_id, seed)
            await self._play(env, seats)
            rewards, game_info = env.close()
            return await self._finish(seats, rewards, game_info, exported)
        finally:
            for pid, seat in seats.items():
                if pid not in exported:
                    await self._releaser.release(seat.session)

    async def _open_seat(self, ctx: EpisodeContext, pid: int, env_id: str,
                         seed: int | None) -> _Seat:
        from openai import AsyncOpenAI

        role = role_name(pid)
        extra: dict[str, object] = {
            "role": role, "episode_id": f"{ctx.episode_id}:{role}",
            "game_episode_id": ctx.episode_id,
            "textarena": {"env_id": env_id, "seed": seed, "player_id": pid},
        }
        # named groups either way: one seat's (one role), or the game's (both seats; refused when
        # the gateway records roles, since advantages are per (task, role))
        extra["group_id"] = f"{ctx.group_id}:{role if self.group_by_role else 'seats'}"
        c = self.config
        session = await open_episode_session(self.client, ctx, c.capacity_wait_s,
                                             c.capacity_poll_s, extra)
        # openai>=3 annotates http_client as an httpx2 client and takes an httpx one as well
        llm = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                          http_client=self.http_client,  # type: ignore[arg-type]
                          max_retries=0)
        return _Seat(role, session, llm)

    async def _play(self, env: Any, seats: dict[int, _Seat]) -> None:
        """TextArena's loop: observe, ask the seat to move, step, until the game is done."""
        for _ in range(self.max_steps):
            pid, observation = env.get_observation()
            seat = seats.get(pid)
            if seat is None:
                raise EpisodeFailed(f"the game asked player {pid} to move; it has "
                                    f"{len(seats)} seats")
            action = await self._act(seat, observation)
            done, _info = env.step(action=action)
            if done:
                return
        raise EpisodeFailed(f"the game did not end within max_steps={self.max_steps} moves")

    async def _act(self, seat: _Seat, observation: Any) -> str:
        """One move: the messages TextArena's OpenAIAgent sends, through the seat's session."""
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": str(observation)}]
        completion = await seat.llm.chat.completions.create(
            model=self.model, messages=messages, max_tokens=self.max_tokens,
            temperature=self.temperature)
        seat.calls += 1
        return (completion.choices[0].message.content or "").strip()

    async def _finish(self, seats: dict[int, _Seat], rewards: Mapping[int, float] | None,
                      game_info: Mapping[int, Any] | None,
                      exported: set[int]) -> dict[str, TrajectoryRow] | None:
        """End each seat's session with the game's reward for it, and export its rows."""
        if not rewards:
            raise EpisodeFailed("the game ended without rewards")
        self._counts["games"] += 1
        self._counts["draws"] += all(float(r) == 0.0 for r in rewards.values())
        self._counts["invalid_move_losses"] += any(
            isinstance(info, Mapping) and info.get("invalid_move")
            for info in (game_info or {}).values())
        out: dict[str, TrajectoryRow] = {}
        c = self.config
        for pid, seat in seats.items():
            if seat.calls == 0:
                continue  # the game ended before this seat moved: nothing of it to train on
            reward = float(rewards[pid])
            if not math.isfinite(reward):
                raise EpisodeFailed(f"the game gave {seat.role} a reward of {reward}")
            await self.client.finalize(seat.session, final_reward=reward)
            rows = await self.client.export(seat.session.session_id, style=c.export_style,
                                            credit=c.credit, discount=c.discount, ack=True)
            exported.add(pid)
            for r in rows:
                row = row_from_dict({"schema_version": SCHEMA_VERSION, **r})
                out[row.interaction_ids[-1]] = row
        return out or None

    def counters(self) -> dict[str, float]:
        """Games played, draws, and games someone lost by invalid moves (cumulative)."""
        return dict(self._counts)

    async def aclose(self) -> None:
        """Wait for session releases in flight; close the seats' HTTP client."""
        await self._releaser.wait()
        if self._http is not None:
            await self._http.aclose()
            self._http = None


def main(argv: list[str] | None = None) -> int:
    """`python -m relayrl.envs.textarena GAME --episodes N`: dataset items as JSONL on stdout."""
    p = argparse.ArgumentParser(prog="python -m relayrl.envs.textarena",
                                description="Write TextArena self-play items (JSONL) for "
                                            "`relayrl train`, or list the games.")
    p.add_argument("env_id", nargs="?", help="a TextArena game id, e.g. TicTacToe-v0")
    p.add_argument("--episodes", type=int, default=64, help="items (games), one seed each")
    p.add_argument("--seed", type=int, default=0, help="the first item's seed")
    p.add_argument("--num-players", type=int, default=2)
    p.add_argument("--list", action="store_true", help="list TextArena's game ids")
    args = p.parse_args(argv)
    try:
        if args.list:
            print("\n".join(game_ids()))
            return 0
        if not args.env_id:
            p.error("name a game id (or --list)")
        for item in make_items(args.env_id, args.episodes, args.seed, args.num_players):
            print(json.dumps(item))
    except (ConfigError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
