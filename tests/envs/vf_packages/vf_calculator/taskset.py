"""Products of two-digit numbers, with calculator tools; the reward reads the last reply."""

import re

import verifiers.v1 as vf

from vf_calculator.tools import CalculatorTools


class ProductData(vf.TaskData):
    """One question and its answer."""

    answer: str


class ProductConfig(vf.TaskConfig):
    """The tool server's placement (verifiers' own `ToolsetConfig`)."""

    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ProductTask(vf.Task[ProductData, vf.State, ProductConfig]):
    """Scored on the last reply; how many tool calls it took is a metric."""

    @classmethod
    def toolsets(cls, config: ProductConfig) -> list[vf.Toolset]:
        return [CalculatorTools(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", (trace.last_reply or "").replace(",", ""))
        return 1.0 if numbers and numbers[-1] == self.data.answer else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class ProductTasksetConfig(vf.TasksetConfig):
    """How many questions."""

    num_tasks: int = 8
    task: ProductConfig = ProductConfig()


class CalculatorTaskset(vf.Taskset[ProductTask, ProductTasksetConfig]):
    """`num_tasks` questions `a * b` with two-digit a and b."""

    def load(self) -> list[ProductTask]:
        tasks = []
        for i in range(self.config.num_tasks):
            a, b = 12 + 7 * i, 34 + 3 * i
            data = ProductData(prompt=f"What is {a} * {b}? Use the multiply tool, then "
                                      "answer with the number.", answer=str(a * b))
            tasks.append(ProductTask(data, self.config.task))
        return tasks
