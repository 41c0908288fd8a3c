"""Tool calls: how tools reach the prompt, how a forced choice is enforced, how calls are read back.

- The prompt: a chat template that knows a tool-call format (mlx-lm infers one and its parser from the
  template, e.g. Qwen's `<tool_call>`) renders the tools and the history's calls itself. Other templates
  (SmolLM2's) get the tools in the system message, in the `<tool_call>{"name", "arguments"}</tool_call>`
  format (Hermes', mlx-lm's json_tools), and the history's calls and results as text in that format.
- tool_choice "auto": the model decides, in its own format; its calls are parsed out of the text.
- tool_choice "required" or a named function: a grammar (engine/model/grammar.py) makes the output the
  call itself, its arguments following the tool's parameter schema, so any model returns valid
  arguments. A forced choice makes one call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine import JSON_GRAMMAR_OPTIONS, Grammar

from deployments.ingress.schemas import ChatCompletionRequest
from deployments.ingress.schemas_tools import DeltaFunction, DeltaToolCall, ToolCall, ToolCallFunction

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_REQUIRED_PREFIX = re.compile(r'^\{"name": "([A-Za-z0-9_-]+)", "arguments": ')


@dataclass(frozen=True)
class ToolFormat:
    """How one model writes tool calls: its markers and the parser of the text between them."""

    start: str
    end: str
    native: bool  # the chat template renders tools and calls itself
    parse: Callable[[str, Any], dict]  # the text between the markers -> {"name", "arguments"}


def tool_format(tokenizer: Any) -> ToolFormat:
    """The model's own format where mlx-lm knows it, else the Hermes format told in the system prompt."""
    if getattr(tokenizer, "has_tool_calling", False):
        return ToolFormat(tokenizer.tool_call_start, tokenizer.tool_call_end, True, tokenizer.tool_parser)
    return ToolFormat(HERMES_START, HERMES_END, False, lambda text, tools: json.loads(text.strip()))


@dataclass(frozen=True)
class ToolPlan:
    """What a request's output is, tool-wise: mode "auto", "required" or "named"."""

    mode: str
    names: tuple[str, ...]
    tools_json: str  # the request's tools, for parsers that read parameter types

    def tools(self) -> list[dict]:
        return json.loads(self.tools_json)


def plan_for(req: ChatCompletionRequest) -> Optional[ToolPlan]:
    mode = req.tool_mode()
    if mode == "none":
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = (req.tool_choice.function.name,) if mode == "named" else tuple(t.function.name for t in req.tools)
    return ToolPlan(mode, names, json.dumps(tools))


def _compact(schema: Optional[dict]) -> dict:
    """The tool's parameter schema (any object if none), with compact JSON (grammar.JSON_GRAMMAR_OPTIONS)."""
    schema = dict(schema or {"type": "object"})
    schema["x-guidance"] = {**JSON_GRAMMAR_OPTIONS, **schema.get("x-guidance", {})}
    return schema


def forced_grammar(req: ChatCompletionRequest) -> Optional[Grammar]:
    """The grammar of a forced tool choice: the named function's arguments, or one call of any tool
    written as {"name": ..., "arguments": ...}."""
    mode = req.tool_mode()
    params = {t.function.name: t.function.parameters for t in req.tools or ()}
    if mode == "named":
        return Grammar("json_schema", json.dumps(_compact(params[req.tool_choice.function.name])))
    if mode != "required":
        return None
    rules = []
    for i, (name, schema) in enumerate(params.items()):
        prefix = json.dumps('{"name": "' + name + '", "arguments": ')  # a Lark string literal
        rules.append(f'call_{i}: {prefix} %json{json.dumps(_compact(schema))} "}}"')
    alternatives = " | ".join(f"call_{i}" for i in range(len(rules)))
    return Grammar("lark", f"start: {alternatives}\n" + "\n".join(rules))


# ----------------------------------------------------------------------------- the prompt


def _system_tools_text(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t) for t in tools)
    return ("You may call one or more functions to assist with the user query.\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n"
            "For each function call, return a json object with function name and arguments within "
            f"{HERMES_START}{HERMES_END} XML tags:\n{HERMES_START}\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n' + HERMES_END)


def template_messages(req: ChatCompletionRequest, fmt: ToolFormat, texts: list[str]) -> tuple[list[dict], Optional[list]]:
    """(messages for the chat template, tools for it or None). `texts`: each message's checked text."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()] if req.tool_mode() != "none" else []
    messages = []
    for m, text in zip(req.messages, texts):
        if fmt.native:
            msg: dict[str, Any] = {"role": m.role, "content": text}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
            messages.append(msg)
        elif m.role == "tool":
            messages.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            calls = "".join(f"{HERMES_START}\n{json.dumps({'name': c.function.name, 'arguments': _arguments(c.function.arguments)})}\n{HERMES_END}"
                            for c in m.tool_calls or ())
            messages.append({"role": m.role, "content": text + calls})
    if tools and not fmt.native:
        prompt = _system_tools_text(tools)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages, (tools if fmt.native and tools else None)


def _arguments(text: str) -> Any:
    """A call's arguments as templates expect them (an object), the text itself if it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


# ----------------------------------------------------------------------------- the output


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(parsed: Any) -> Optional[ToolCall]:
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    args = parsed.get("arguments", {})
    return ToolCall(id=new_call_id(), function=ToolCallFunction(
        name=parsed["name"], arguments=args if isinstance(args, str) else json.dumps(args)))


def parse_output(plan: ToolPlan, fmt: ToolFormat, text: str) -> tuple[Optional[str], list[ToolCall]]:
    """(content, tool calls) of a finished output."""
    if plan.mode == "named":
        return None, [ToolCall(id=new_call_id(), function=ToolCallFunction(name=plan.names[0], arguments=text))]
    if plan.mode == "required":
        m = _REQUIRED_PREFIX.match(text)
        if m is None:  # cut by max_tokens before the name was complete
            return None, []
        args = text[m.end():]
        return None, [ToolCall(id=new_call_id(), function=ToolCallFunction(
            name=m.group(1), arguments=args[:-1] if args.endswith("}") else args))]
    calls, content, pos = [], [], 0
    while (start := text.find(fmt.start, pos)) >= 0:
        end = text.find(fmt.end, start + len(fmt.start))
        content.append(text[pos:start])
        body = text[start + len(fmt.start): end if end >= 0 else len(text)]
        pos = end + len(fmt.end) if end >= 0 else len(text)
        try:
            call = _call(fmt.parse(body, plan.tools()))
        except Exception:  # noqa: BLE001 - not a call after all: it stays text
            call = None
        if call is None:
            content.append(text[start:pos])
        else:
            calls.append(call)
    content.append(text[pos:])
    joined = "".join(content)
    return (joined.strip() or None) if calls else joined, calls


class ToolStream:
    """Turns one choice's streamed text into content and tool-call deltas, as OpenAI streams them."""

    def __init__(self, plan: ToolPlan, fmt: ToolFormat):
        self._plan, self._fmt = plan, fmt
        self._text = ""  # all text so far
        self._sent = 0  # characters of _text already turned into deltas
        self._call_started = False
        self.num_calls = 0

    def feed(self, new_text: str, final: bool) -> tuple[Optional[str], list[DeltaToolCall]]:
        """(a content delta or None, tool-call deltas) for the next piece of text."""
        self._text += new_text
        if self._plan.mode == "auto":
            return self._feed_auto(final)
        deltas = []
        if not self._call_started:
            if self._plan.mode == "named":
                name, header_end = self._plan.names[0], 0
            elif (m := _REQUIRED_PREFIX.match(self._text)) is not None:
                name, header_end = m.group(1), m.end()
            else:
                return None, []
            self._call_started, self._sent, self.num_calls = True, header_end, 1
            deltas.append(DeltaToolCall(index=0, id=new_call_id(), type="function",
                                        function=DeltaFunction(name=name, arguments="")))
        end = len(self._text)
        if self._plan.mode == "required":  # its last character closes the call, not the arguments
            end = end - 1 if not final or self._text.endswith("}") else end
        if end > self._sent:
            deltas.append(DeltaToolCall(index=0, function=DeltaFunction(arguments=self._text[self._sent:end])))
            self._sent = end
        return None, deltas

    def _feed_auto(self, final: bool) -> tuple[Optional[str], list[DeltaToolCall]]:
        start = self._text.find(self._fmt.start, self._sent)
        if start < 0 and not final:  # content, less what could be the start of a call's marker
            keep = next((k for k in range(len(self._fmt.start) - 1, 0, -1)
                         if self._text.endswith(self._fmt.start[:k])), 0)
            content, self._sent = self._text[self._sent: len(self._text) - keep], len(self._text) - keep
            return content or None, []
        if not final:
            content, self._sent = self._text[self._sent:start], start
            return content or None, []
        rest = self._text[self._sent:]
        content, calls = parse_output(self._plan, self._fmt, rest)
        self._sent = len(self._text)
        if not calls:
            return rest or None, []
        self.num_calls = len(calls)
        return content, [DeltaToolCall(index=i, id=c.id, type="function", function=DeltaFunction(
            name=c.function.name, arguments=c.function.arguments)) for i, c in enumerate(calls)]
