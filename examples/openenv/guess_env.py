"""A small OpenEnv environment built with OpenEnv's own classes: guess a digit in three tries.

`reset(seed)` picks the digit; each `step` takes a guess and answers "higher", "lower" or
"correct". The reward is delayed: None on every step but the last, then 1.0 for a correct guess
and 0.0 when the tries run out. Served by OpenEnv's `create_app`, like any OpenEnv server:

    uvicorn guess_env:app --host 127.0.0.1 --port 8001     # from this folder

or started by relayrl itself (`OpenEnvAgent(environment="guess_env:GuessEnvironment")`).
"""

from __future__ import annotations

import random
import re
from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TRIES = 3


class GuessAction(Action):
    """A guess, as text: the first digit in it counts."""

    guess: str = Field(..., description="Your guess: a digit from 0 to 9")


class GuessObservation(Observation):
    """What the game says about the last guess."""

    feedback: str = Field(default="", description="The game's answer")
    tries_left: int = Field(default=TRIES, description="Guesses left")


class GuessEnvironment(Environment):
    """Guess the digit; the reward comes only at the end of the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        """A new digit, drawn from `seed`."""
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._secret = random.Random(seed).randrange(10)
        return GuessObservation(feedback="I picked a digit from 0 to 9. Guess it: reply with one "
                                         "digit.", tries_left=TRIES)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        """Answer a guess; the episode ends on a correct guess or the last try."""
        self._state.step_count += 1
        tries_left = TRIES - self._state.step_count
        match = re.search(r"\d", action.guess)
        if match is not None and int(match.group()) == self._secret:
            return GuessObservation(feedback="correct", tries_left=tries_left, done=True,
                                    reward=1.0)
        if tries_left <= 0:
            return GuessObservation(feedback=f"wrong; it was {self._secret}", tries_left=0,
                                    done=True, reward=0.0)
        if match is None:
            feedback = "that is not a digit; reply with one digit"
        else:
            feedback = "higher" if int(match.group()) < self._secret else "lower"
        return GuessObservation(feedback=feedback, tries_left=tries_left)

    @property
    def state(self) -> State:
        """The episode id and steps taken."""
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess",
                 max_concurrent_envs=64)
