"""The calculator's tools: plain Python functions, served over MCP by verifiers."""

import verifiers.v1 as vf


class CalculatorTools(vf.Toolset[vf.ToolsetConfig]):
    """`add` and `multiply` on integers."""

    TOOL_PREFIX = None  # the model sees `add` and `multiply`, not `calculator_tools_add`

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b

    @vf.tool
    async def multiply(self, a: int, b: int) -> int:
        """Multiply two integers and return the product."""
        return a * b


if __name__ == "__main__":  # verifiers starts each rollout's tool server as `python -m` this
    CalculatorTools.run()
