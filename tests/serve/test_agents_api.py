"""The API agents use, end to end: real Ray Serve, the tiny random model, the official `openai` client.

Structured output (client.chat.completions.parse with a pydantic model, a streamed json_schema answer,
/v1/completions), forced tool calls streamed and not, tool history, logprobs, penalties, and a batch
where constrained and free requests decode together. The model is random: its constrained answers
parse only because the grammar forces them to.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from deployments.app import APP_NAME, build_app
from deployments.ingress.schemas import ChatCompletionRequest, ChatCompletionResponse

MODEL = "tiny"
ENGINE = {"model": MODEL, "max_num_seqs": 8, "max_num_batched_tokens": 256, "prefill_chunk_size": 128,
          "max_model_len": 2048, "memory_limit_bytes": 2 << 30}
APP_ARGS = {"engine": ENGINE, "num_replicas": 1, "replica": {"num_cpus": 0.5, "health_check_period_s": 2.0},
            "ingress": {"num_cpus": 0.1}, "max_n": 2, "max_tokens_cap": 2000}
MESSAGES = [{"role": "user", "content": "Describe a city."}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=1000)
    capital: bool
    kind: Literal["town", "city"]


# what strict mode asks of a schema (client.chat.completions.parse adds it); without it, a random model
# adds keys of its own, with strings that need not end before max_tokens
CITY_SCHEMA = {**City.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def client(ray_cluster):
    from ray import serve

    serve.run(build_app(APP_ARGS), name=APP_NAME, route_prefix="/")
    yield openai.OpenAI(base_url=f"{ray_cluster}/v1", api_key="unused", max_retries=0, timeout=120)
    serve.delete(APP_NAME)


def test_parse_with_a_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City, max_tokens=200,
                                      temperature=0.7, seed=3)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"


def test_streamed_json_schema_answer_parses(client):
    schema = CITY_SCHEMA
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # streamed, not one piece
    City.model_validate(json.loads(text))
    assert chunks[-1].choices[0].finish_reason == "stop"
    # on /v1/completions too (json_object: any object; a random model's free strings may not end in time)
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=200, extra_body={"response_format": {
        "type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    City.model_validate(json.loads(r.choices[0].text))
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=8,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")


def test_a_schema_that_cannot_compile_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
    assert "objectx" in err.value.message and err.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"guided_json": {}})
    assert err.value.body["param"] == "guided_json"


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_call_arguments_follow_the_schema(client, choice):
    tool_choice = {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2 + 3?"}],
                                       tools=TOOLS, tool_choice=tool_choice, max_tokens=120)
    choice0 = r.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    (call,) = choice0.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    schema = {"add": ADD, "get_weather": WEATHER}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if choice == "named":
        assert call.function.name == "add"
    # streamed: a first delta with index, id and name, then argument fragments
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "2 + 3?"}], tools=TOOLS, tool_choice=tool_choice,
        max_tokens=120, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].function.name == call.function.name
    assert len(deltas) > 2 and all(d.index == 0 and d.id is None for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == call.function.arguments  # greedy: the same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parse_a_forced_tool_call_into_a_pydantic_model(client):
    class Add(BaseModel):
        a: int = Field(ge=0, le=99)
        b: int = Field(ge=0, le=99)

    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "2 + 3?"}],
                                      tools=[openai.pydantic_function_tool(Add)], max_tokens=60,
                                      tool_choice={"type": "function", "function": {"name": "Add"}})
    assert isinstance(r.choices[0].message.tool_calls[0].function.parsed_arguments, Add)


def test_tool_history_is_accepted(client):
    messages = [{"role": "user", "content": "2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens >= 1


def test_logprobs_with_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob) and item.logprob <= 0
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    assert "".join(i.token for i in content) == r.choices[0].message.content
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                          temperature=0, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [i.token for c in streamed for i in c.choices[0].logprobs.content] == [i.token for i in content]
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5 and lp.text_offset[0] == 0


def test_penalties_change_the_output(client):
    def tokens(**extra):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, temperature=0, logprobs=0,
                                      logit_bias={"100": 15}, **extra)
        return r.choices[0].logprobs.tokens

    biased = tokens()
    assert len(set(biased)) == 1  # the bias makes the random model repeat one token
    assert len(set(tokens(frequency_penalty=2.0))) > 1
    assert len(set(tokens(extra_body={"repetition_penalty": 3.0}))) > 1


def test_constrained_and_free_requests_decode_together(client):
    """Free greedy requests give the same answer alone and next to constrained ones (one replica,
    max_num_seqs 8: they share decode steps)."""
    prompts = [f"Story {i}:" for i in range(4)]

    def free(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0).choices[0].text

    def constrained(i):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=i,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "city", "schema": CITY_SCHEMA}})
        return r.choices[0].message.content

    alone = [free(p) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        mixed_free = [pool.submit(free, p) for p in prompts]
        mixed_constrained = [pool.submit(constrained, i) for i in range(4)]
        assert [f.result() for f in mixed_free] == alone
        for f in mixed_constrained:
            City.model_validate(json.loads(f.result()))


def test_handle_calls_take_the_same_fields(client):
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)
    req = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=80,
                                tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                logprobs=True, top_logprobs=2, frequency_penalty=0.5)

    async def call():
        return await handle.chat.remote(req)

    r = asyncio.run(call())
    assert isinstance(r, ChatCompletionResponse) and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), WEATHER)
    # tokens the grammar forbids are not in the distribution: a forced token has no alternatives
    content = r.choices[0].logprobs.content
    assert all(1 <= len(i.top_logprobs) <= 2 and i.logprob <= 0 for i in content)
    assert any(len(i.top_logprobs) == 1 and i.logprob == 0 for i in content)
