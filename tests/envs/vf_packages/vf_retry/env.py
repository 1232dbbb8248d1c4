"""Additions answered over several turns: a wrong answer gets feedback and another try."""

import re

import verifiers.v1 as vf


def last_number(text: str) -> str | None:
    """The last integer in `text`, if any."""
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


class RetryData(vf.TaskData):
    """One question and its answer."""

    answer: str


class RetryTask(vf.Task[RetryData]):
    """Full reward for a right final answer, less for each retry it took."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if last_number(trace.last_reply or "") == self.data.answer else 0.0

    @vf.reward(weight=0.5)
    async def first_try(self, trace: vf.Trace) -> float:
        replies = trace.assistant_messages
        return 1.0 if replies and last_number(replies[0].content or "") == self.data.answer \
            else 0.0

    @vf.metric
    async def attempts(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class RetryTasksetConfig(vf.TasksetConfig):
    """How many questions."""

    num_tasks: int = 8


class RetryTaskset(vf.Taskset[RetryTask, RetryTasksetConfig]):
    """`num_tasks` questions `a + b`."""

    def load(self) -> list[RetryTask]:
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = 3 + i, 5 + 2 * i
            data = RetryData(prompt=f"What is {a} + {b}? Answer with the number.",
                             answer=str(a + b))
            tasks.append(RetryTask(data, self.config.task))
        return tasks


class RetryEnvConfig(vf.EnvConfig):
    """The solver's seat and how many answers it may give."""

    solver: vf.AgentConfig = vf.AgentConfig()
    max_attempts: int = 3


class RetryEnv(vf.Env[RetryEnvConfig]):
    """The environment's side of the conversation: check each answer, ask again if wrong."""

    async def run(self, task: RetryTask, agents: vf.Agents) -> None:
        async with agents.solver.interaction(task) as chat:
            reply = await chat.turn()  # a prompted task speaks first
            for _ in range(self.config.max_attempts - 1):
                if reply.terminated or last_number(reply.last_reply) == task.data.answer:
                    break
                reply = await chat.turn("That is not right. Check the sum and answer again.")
