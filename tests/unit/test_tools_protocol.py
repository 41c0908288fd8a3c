"""Pure logic of structured output, tool calls and the new sampling fields: request models, the grammars
of forced tool choices, the prompt with tools, tool calls parsed and streamed (no model, no Ray)."""

from __future__ import annotations

import json

import pytest

from deployments.errors import BadRequestError
from deployments.ingress import tools
from deployments.ingress.protocol import Limits, make_samplings, request_grammar
from deployments.ingress.schemas import ChatCompletionRequest, CompletionRequest
from engine import check_grammar

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "now"}}]
HERMES = tools.ToolFormat(tools.HERMES_START, tools.HERMES_END, False, lambda text, _: json.loads(text))
LIMITS = Limits(max_model_len=2048, vocab_size=1000)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                 **fields})


def test_request_fields_are_checked():
    for bad in ({"top_logprobs": 2}, {"tool_choice": "required"}, {"logit_bias": {"x": 1.0}},
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"presence_penalty": 2.5}, {"min_p": 1.5}, {"functions": []},
                {"response_format": {"type": "json_schema"}}):
        with pytest.raises(ValueError):
            chat(**bad)
    r = chat(user="u", metadata={"k": "v"}, store=False, service_tier="auto", logprobs=True, top_logprobs=3)
    assert r.tool_mode() == "none"
    assert chat(tools=TOOLS).tool_mode() == "auto" and chat(tools=TOOLS, tool_choice="none").tool_mode() == "none"
    s = make_samplings(chat(logprobs=True, top_logprobs=3, logit_bias={"7": -5.0}, frequency_penalty=0.5,
                            repetition_penalty=1.2, min_p=0.1), 8, LIMITS)[0]
    assert (s.logprobs, s.logit_bias[0].token_id, s.logit_bias[0].bias) == (3, 7, -5.0)
    assert (s.frequency_penalty, s.repetition_penalty, s.min_p, s.grammar) == (0.5, 1.2, 0.1, None)
    with pytest.raises(BadRequestError) as err:
        make_samplings(chat(logit_bias={"5000": 1.0}), 8, LIMITS)
    assert err.value.param == "logit_bias"
    assert make_samplings(CompletionRequest(model="m", prompt="x", logprobs=2), 8, LIMITS)[0].logprobs == 2


def test_grammars_of_response_formats_and_forced_choices_compile():
    g = request_grammar(chat(response_format={"type": "json_object"}))
    assert g.kind == "json_schema" and json.loads(g.source) == {"type": "object"}
    assert request_grammar(chat(response_format={"type": "text"})) is None
    assert request_grammar(chat(tools=TOOLS)) is None  # auto: the model's own format, no grammar
    named = request_grammar(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}))
    assert json.loads(named.source)["properties"] == ADD["properties"]
    required = request_grammar(chat(tools=TOOLS, tool_choice="required"))
    assert required.kind == "lark" and '\\"name\\": \\"now\\"' in required.source
    check_grammar(required)
    with pytest.raises(BadRequestError) as err:
        request_grammar(chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}))
    assert err.value.param == "response_format" and "nonsense" in str(err.value)
    with pytest.raises(BadRequestError):  # a json answer and tool calls at once
        request_grammar(chat(tools=TOOLS, response_format={"type": "json_object"}))


def test_prompt_with_tools_and_history_without_a_native_format():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    req = chat(messages=messages, tools=TOOLS)
    out, template_tools = tools.template_messages(req, HERMES, [m.text() for m in req.messages])
    assert template_tools is None and out[0]["role"] == "system" and "<tools>" in out[0]["content"]
    assert out[0]["content"].startswith("Be brief.")
    assert out[2]["content"] == '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    assert out[3] == {"role": "user", "content": "<tool_response>\n5\n</tool_response>"}
    native = tools.ToolFormat("<tool_call>", "</tool_call>", True, HERMES.parse)
    out, template_tools = tools.template_messages(req, native, [m.text() for m in req.messages])
    assert template_tools[0]["function"]["name"] == "add" and out[3]["tool_call_id"] == "c1"
    assert out[2]["tool_calls"][0]["function"]["arguments"] == {"a": 2}


def test_tool_calls_are_parsed_and_streamed():
    auto = tools.ToolPlan("auto", ("add", "now"), json.dumps(TOOLS))
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "now"}</tool_call>'
    content, calls = tools.parse_output(auto, HERMES, text)
    assert content == "Let me add." and [c.function.name for c in calls] == ["add", "now"]
    assert json.loads(calls[0].function.arguments) == {"a": 1} and calls[1].function.arguments == "{}"
    assert tools.parse_output(auto, HERMES, "no call <tool_call>{broken") == ("no call <tool_call>{broken", [])
    stream = tools.ToolStream(auto, HERMES)
    pieces = [stream.feed(text[i:i + 4], False) for i in range(0, len(text), 4)] + [stream.feed("", True)]
    assert "".join(c for c, _ in pieces if c) == "Let me add. "  # never a piece of the marker
    deltas = [d for _, ds in pieces for d in ds]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "add"), (1, "now")]

    required = tools.ToolPlan("required", ("add", "now"), json.dumps(TOOLS))
    text = '{"name": "add", "arguments": {"a": 12}}'
    assert tools.parse_output(required, HERMES, text)[1][0].function.arguments == '{"a": 12}'
    stream = tools.ToolStream(required, HERMES)
    deltas = [d for i in range(0, len(text), 3) for d in stream.feed(text[i:i + 3], False)[1]]
    deltas += stream.feed("", True)[1]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "add"
    assert "".join(d.function.arguments for d in deltas) == '{"a": 12}'

    named = tools.ToolPlan("named", ("add",), json.dumps(TOOLS))
    stream = tools.ToolStream(named, HERMES)
    first = stream.feed('{"a"', False)[1]
    assert first[0].function.name == "add" and first[1].function.arguments == '{"a"'


def test_a_streams_accumulator_keeps_the_usage_not_the_content():
    from deployments.ingress.responses import Accumulator
    from deployments.messages import GenerateOutput
    from engine import TokenLogprob

    outs = [GenerateOutput("r", "rep", text, 1, 5, i + 1, finished=i == 2, finish_reason="stop" if i == 2 else None,
                           new_logprobs=(TokenLogprob(i, -0.5),)) for i, text in enumerate(("a", "b", "c"))]
    kept, streamed = Accumulator(1), Accumulator(1, keep_content=False)
    for out in outs:
        kept.add(0, out)
        streamed.add(0, out)
    assert "".join(kept.choices[0].text_parts) == "abc" and len(kept.choices[0].logprobs) == 3
    assert streamed.choices[0].text_parts == [] and streamed.choices[0].logprobs == []
    assert streamed.usage() == kept.usage() and streamed.usage().completion_tokens == 3
    assert streamed.fingerprint() == "rep" and streamed.choices[0].finish_reason == "stop"
