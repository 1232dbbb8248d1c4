"""The math agent as LangGraph's prebuilt ReAct agent (`create_react_agent`) over `ChatOpenAI`.

    python examples/frameworks/langgraph_react.py

No relayrl import: `ChatOpenAI` gets the gateway's base URL and the session key.
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent
from mathtask import INSTRUCTIONS, add, check_answer, multiply, question, service_root


async def run(task: dict[str, Any], *, base_url: str, api_key: str, max_tokens: int = 64,
              max_turns: int = 4, **extra: Any) -> float:
    """Answer the task's question; the reward is `check_answer` on the last message."""
    llm = ChatOpenAI(model="default", base_url=service_root(base_url) + "/v1", api_key=api_key,
                     max_tokens=max_tokens, max_retries=0)
    agent = create_react_agent(llm, tools=[tool(add), tool(multiply)], prompt=INSTRUCTIONS)
    try:
        state = await agent.ainvoke({"messages": [("user", question(task))]},
                                    config={"recursion_limit": 2 * max_turns})
    except GraphRecursionError:
        return 0.0  # still calling tools after max_turns model calls
    return check_answer(str(state["messages"][-1].content), task["answer"])


if __name__ == "__main__":
    from harness import main

    main(run, __doc__.splitlines()[0])
