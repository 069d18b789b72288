"""``tool_choice: "auto"`` over HTTP for chat templates that know tools — in Hermes/Qwen, Llama 3 and Mistral
syntax — with the official ``openai`` client: the default model serves with such a template (written here in those formats)
and its output is scripted through the executor (tests/executor_faults.py), so the test controls what the
"model" writes — a call, two calls, a reply — and checks the parsed message, the streamed deltas and a
call -> tool result -> answer round trip rendered through the template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from executor_faults import faulty_executor
from server_fixtures import LIVE_CONFIG, LiveServer, start_live_server

from engine.loader.model_loader import LoadedModel
from scheduler.batch import ScheduledBatch

pytestmark = pytest.mark.slow

LLAMA_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>"
    '{%- for c in message.tool_calls %}{"name": "{{ c.function.name }}", "parameters": '
    "{{ c.function.arguments | tojson }}}{%- if not loop.last %}; {% endif %}{%- endfor %}<|eom_id|>"
    "{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{%- endif %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.tool_calls %}[TOOL_CALLS][{%- for c in message.tool_calls %}"
    "{%- if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9') }}"
    '{%- endif %}{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, "id": "{{ c.id }}"}'
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]{{ eos_token }}"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ message.content | tojson }}, "
    '"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- else %}{{ message.content }}{{ eos_token }}{%- endif %}{%- endfor %}"
)
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. <tools>{%- for t in tools %}{{ t | tojson }}"
    '{%- endfor %}</tools> For each call return <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\n{%- endif %}{%- for message in messages %}"
    "{%- if message.tool_calls %}<|im_start|>assistant\n{%- for c in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA_TEMPLATE, "mistral": MISTRAL_TEMPLATE}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"city": "Paris"}
SCRIPTS = {
    ("llama3_json", "call"): '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    ("llama3_json", "two"): '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    ("hermes", "call"): '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ("hermes", "two"): '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
    ("mistral", "call"): '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ("mistral", "two"): '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_weather", "arguments": {"city": "Rome"}}]',
}
REPLY = "It is sunny in Paris today."


@pytest.fixture(scope="module")
def server(default_model: LoadedModel) -> Iterator[LiveServer]:
    with start_live_server(LIVE_CONFIG, loaded=default_model) as live:
        yield live


class Script:
    """What the scripted model writes next: every sampled row is forced to the script's next token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []

    def set(self, text: str) -> None:
        self.ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_ids[0]]

    def edit(self, batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, -100.0)  # NOTE: finite: the engine fails a row with infinite logits
        rows = [chunk for chunk in batch.requests if chunk.needs_sample]
        for row, chunk in enumerate(rows):
            n = len(chunk.request.output_ids)
            forced[row, self.ids[min(n, len(self.ids) - 1)]] = 100.0
        return forced


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral"])
def scripted(
    request: pytest.FixtureRequest, server: LiveServer
) -> Iterator[tuple[str, Script, openai.OpenAI]]:
    tokenizer = server.state.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = TEMPLATES[request.param]
    script = Script(tokenizer)
    client = openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=server.api_key, max_retries=0, timeout=120
    )
    try:
        with faulty_executor(server.state.manager, edit=script.edit):
            yield request.param, script, client
    finally:
        tokenizer.chat_template = saved


def _ask(client: openai.OpenAI, messages: list[Any] | None = None, **kwargs: Any) -> Any:
    messages = messages or [{"role": "user", "content": "What is the weather in Paris?"}]
    return client.chat.completions.create(
        model="smollm2-test", messages=messages, tools=[WEATHER], max_tokens=120, **kwargs
    )


@pytest.mark.parametrize("kind", ["call", "two"])
def test_calls_in_the_template_syntax_become_tool_calls(
    scripted: tuple[str, Script, openai.OpenAI], kind: str
) -> None:
    syntax, script, client = scripted
    script.set(SCRIPTS[(syntax, kind)])
    choice = _ask(client, temperature=0).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    cities = [json.loads(c.function.arguments)["city"] for c in calls]
    assert cities == (["Paris"] if kind == "call" else ["Paris", "Rome"])
    assert all(c.function.name == "get_weather" for c in calls)
    if syntax == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    streamed: dict[int, dict[str, str]] = {}
    for chunk in _ask(client, temperature=0, stream=True):
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = streamed.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += part.function.name or "" if part.function else ""
            call["arguments"] += part.function.arguments or "" if part.function else ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in calls
    ]


def test_a_reply_stays_content(scripted: tuple[str, Script, openai.OpenAI]) -> None:
    _, script, client = scripted
    script.set(REPLY)
    choice = _ask(client, temperature=0).choices[0]
    assert (
        choice.message.content == REPLY and not choice.message.tool_calls and choice.finish_reason == "stop"
    )
    text = "".join(
        c.choices[0].delta.content or "" for c in _ask(client, temperature=0, stream=True) if c.choices
    )
    assert text == REPLY


def test_a_round_trip_renders_through_the_template(scripted: tuple[str, Script, openai.OpenAI]) -> None:
    syntax, script, client = scripted
    script.set(SCRIPTS[(syntax, "call")])
    first = _ask(client, temperature=0).choices[0].message
    script.set(REPLY)
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        first.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 24 degrees"},
    ]
    answer = _ask(client, history, temperature=0).choices[0]
    assert answer.message.content == REPLY
    # NOTE: the template wrote the earlier call's arguments as an object, not a JSON string encoded twice.
    tokenizer = script.tokenizer
    rendered = tokenizer.decode(
        tokenizer.apply_chat_template(
            [
                history[0],
                {
                    **history[1],
                    "tool_calls": [
                        {**c, "function": {**c["function"], "arguments": CALL}}
                        for c in history[1]["tool_calls"]
                    ],
                },
                history[2],
            ],
            tools=[WEATHER],
            add_generation_prompt=True,
            tokenize=True,
        ),
        skip_special_tokens=False,
    )
    assert json.dumps(CALL) in rendered
