"""An agent framework from PyPI (``langchain-openai``) driving the server end to end on the real default
model: a structured extraction into a pydantic model, and a tool call chosen by the model (``auto``, the
framework's default) that the framework parses into its own ``tool_calls``."""

from __future__ import annotations

from typing import Literal

import pydantic
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from server_fixtures import LiveServer

pytestmark = pytest.mark.slow


class Person(pydantic.BaseModel):
    """A person mentioned in the text."""

    # NOTE: additionalProperties false: a schema that allows more keys lets a small model add keys until
    # max_tokens (valid JSON so far, but never finished).
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


class GetWeather(pydantic.BaseModel):
    """The current weather in a city."""

    model_config = pydantic.ConfigDict(extra="forbid")

    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def chat_model(live_server: LiveServer) -> ChatOpenAI:
    return ChatOpenAI(
        model=live_server.model,
        base_url=f"{live_server.base_url}/v1",
        api_key=live_server.api_key,
        temperature=0,
        max_tokens=80,
        max_retries=0,
        timeout=180,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_extraction(chat_model: ChatOpenAI, method: str) -> None:
    extractor = chat_model.with_structured_output(Person, method=method)
    person = extractor.invoke("Alice is 30 years old. Extract the person.")
    assert isinstance(person, Person)


# NOTE: a worked example first (as in tests/server/test_tool_calls_auto_live.py): unprompted, a 135M model
# answers in words.
EXAMPLE: list[BaseMessage] = [
    HumanMessage("What is the weather in Rome?"),
    AIMessage(
        "", tool_calls=[{"name": "GetWeather", "args": {"city": "Rome", "unit": "celsius"}, "id": "call_0"}]
    ),
    ToolMessage("21 degrees and cloudy", tool_call_id="call_0"),
    AIMessage("It is 21 degrees and cloudy in Rome."),
]


def test_a_tool_call_chosen_by_the_model(chat_model: ChatOpenAI) -> None:
    question = HumanMessage("What is the weather in Paris?")
    message = chat_model.bind_tools([GetWeather]).invoke([*EXAMPLE, question])
    assert not message.invalid_tool_calls
    assert [call["name"] for call in message.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(message.tool_calls[0]["args"])
    assert message.response_metadata["finish_reason"] == "tool_calls"
