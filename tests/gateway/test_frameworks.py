"""Agent frameworks run unchanged against the gateway: openai-agents and langchain-openai."""

from __future__ import annotations

from openai import AsyncOpenAI

from tests.gateway.conftest import Gateway
from tests.gateway.test_openai_chat import call


async def test_an_openai_agents_agent_uses_function_tools_through_the_gateway(gw: Gateway) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    used: list[tuple[float, float]] = []

    @function_tool
    def multiply(a: float, b: float) -> float:
        """Multiply two numbers."""
        used.append((a, b))
        return a * b

    gw.script.replies += [call("multiply", a=6, b=7), "6 times 7 is 42."]
    s = gw.start_session(task_id="agents")
    client = AsyncOpenAI(base_url=gw.url + "/v1", api_key=s["api_key"], max_retries=0)
    agent = Agent(name="calc", instructions="Use tools for arithmetic.", tools=[multiply],
                  model=OpenAIChatCompletionsModel(model="relayrl-test", openai_client=client))
    result = await Runner.run(agent, "What is 6 times 7?", max_turns=4)
    assert used == [(6, 7)]
    assert "42" in result.final_output
    rows = gw.export(s["session_id"], style="concat")
    assert len(rows) == 1  # the agent's second call extended its first
    assert sum(rows[0]["loss_mask"]) > 0
    await client.close()


def test_a_langchain_chat_model_with_bound_tools_gets_tool_calls(gw: Gateway) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def add(a: float, b: float) -> float:
        """Add two numbers."""
        return a + b

    gw.script.replies += [call("add", a=2, b=2), "Two plus two is four."]
    s = gw.start_session()
    llm = ChatOpenAI(model="relayrl-test", base_url=gw.url + "/v1", api_key=s["api_key"],
                     max_retries=0).bind_tools([add])
    history = [HumanMessage("2+2?")]
    ai = llm.invoke(history)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "add"
    assert ai.tool_calls[0]["args"] == {"a": 2, "b": 2}
    history += [ai, ToolMessage(str(add.invoke(ai.tool_calls[0]["args"])),
                                tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.invoke(history)
    assert final.content == "Two plus two is four."
    assert len(gw.export(s["session_id"], style="concat")) == 1
