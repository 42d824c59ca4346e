"""The OpenAI Agents SDK, unmodified, running an agent with a function tool against the server."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

agents = pytest.importorskip("agents")

MODEL = "SmolLM2-135M-Instruct"


def _chat_model(server):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    return agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)


def test_agent_with_a_function_tool_chat_completions_model(server):
    agents.set_tracing_disabled(True)
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        seen.append(city)
        return f"It is sunny and 21 C in {city}."

    agent = agents.Agent(
        name="weather",
        instructions="You answer weather questions. Use the get_weather tool.",
        tools=[get_weather],
        model=_chat_model(server),
        # Force the first turn's call; the SDK resets tool_choice after a call (so no loop).
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
    )
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert len(seen) >= 1 and all(isinstance(c, str) and c for c in seen)
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds
    assert isinstance(result.final_output, str)


class City(BaseModel):
    name: str
    country: str


def test_agent_structured_output_type(server):
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="geo",
        instructions="Answer with the city asked about.",
        model=_chat_model(server),
        output_type=City,
        model_settings=agents.ModelSettings(temperature=0, max_tokens=60),
    )
    result = asyncio.run(agents.Runner.run(agent, "Which city is the Eiffel Tower in?"))
    assert isinstance(result.final_output, City)
