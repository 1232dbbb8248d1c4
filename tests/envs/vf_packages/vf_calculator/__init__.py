"""A verifiers v1 tool environment, built with verifiers' own classes for the tests.

The v1 form of a `ToolEnv`: the task's tools are plain Python functions on a `vf.Toolset`
(`@vf.tool`), which verifiers serves over MCP per rollout and its chat harness offers the model
as function tools. Installed for the tests by putting this folder on the path (as `pip install`
would) and loaded by its id, `vf-calculator`.
"""

from vf_calculator.taskset import CalculatorTaskset

__all__ = ["CalculatorTaskset"]
