"""Two-number additions; the reward is 1.0 when the model's last reply holds the sum."""

import re

import verifiers.v1 as vf


class AdditionData(vf.TaskData):
    """One question and its answer."""

    answer: str


class AdditionTask(vf.Task[AdditionData]):
    """Scores the last reply: its last number against the answer."""

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return 1.0 if numbers and numbers[-1] == self.data.answer else 0.0


class AdditionConfig(vf.TasksetConfig):
    """How many questions."""

    num_tasks: int = 8


class AdditionTaskset(vf.Taskset[AdditionTask, AdditionConfig]):
    """`num_tasks` questions `a + b` with a, b in 1..9."""

    def load(self) -> list[AdditionTask]:
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = 1 + i % 9, 1 + (3 * i + 2) % 9
            data = AdditionData(prompt=f"What is {a} + {b}? Answer with the number.",
                                answer=str(a + b))
            tasks.append(AdditionTask(data, self.config.task))
        return tasks
