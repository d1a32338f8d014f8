"""Chat tools: what a request's `tools`, `tool_choice` and `parallel_tool_calls` do.

- The prompt: the conversation as the chat template takes it (prompts.py renders it), assistant
  tool calls and `role: "tool"` results included. A template with a tool format gets the tools
  as its `tools`; for one without (or the plain template of BLOOM checkpoints) a system message
  lists the functions and asks for a reply that is only {"name": ..., "arguments": {...}}.
- The decoding: with `required` or a named function, the reply is constrained (constrained.py)
  to calls of the tool's JSON schema in the family's format (tool_formats.py), so it is always a
  valid call; with `auto` it is free, and read back as calls only if it parses as calls.
- The reply: ToolCallReader turns a choice's text, as it arrives, into content and OpenAI's tool
  calls (each call's name first, then its arguments as they are written).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from .constrained import Grammar, GrammarCompiler, UnsupportedGrammar
from .errors import ApiError
from .openai_schema import ChatMessage, Tool
from .tool_formats import CallFormat, call_format_for_template

__all__ = ["ChatTools", "ReadCall", "ToolCallReader", "conversation"]

_CALL_INSTRUCTIONS = ("You can call these functions:\n{functions}\nTo call one, reply with only a JSON object: "
                      '{{"name": <the function\'s name>, "arguments": <its arguments, a JSON object>}}.')


def conversation(messages: Sequence[ChatMessage]) -> list[dict]:
    """The messages as chat templates take them: an assistant's tool calls with their arguments as
    objects, a tool result with the name of the function it answers. A 400 names the message whose
    tool_call_id answers no earlier call, or whose call's arguments are not a JSON object."""
    called: dict[str, str] = {}  # tool call id -> function name
    result = []
    for index, message in enumerate(messages):
        try:
            entry = {"role": message.role, "content": message.text()}
        except ValueError as exc:
            raise ApiError.invalid(f"messages.{index}: {exc}", f"messages.{index}.content") from None
        if message.reasoning_content:  # as Qwen3's template reads it, and gpt-oss's ("thinking")
            entry.update(reasoning_content=message.reasoning_content, thinking=message.reasoning_content)
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call, index) for call in message.tool_calls]
            called.update((call.id, call.function.name) for call in message.tool_calls)
        if message.role == "tool":
            if message.tool_call_id not in called:
                raise ApiError.invalid(f"messages.{index}: tool_call_id {message.tool_call_id!r} answers no tool call "
                                       f"of an earlier assistant message", f"messages.{index}.tool_call_id")
            entry.update(tool_call_id=message.tool_call_id, name=called[message.tool_call_id])
        result.append(entry)
    return result


def _template_call(call, index: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError.invalid(f"messages.{index}: the arguments of tool call {call.id!r} are not a JSON object",
                               f"messages.{index}.tool_calls")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


@dataclass
class ChatTools:
    """A request's tools and how its replies use them."""

    tools: list[Tool]
    mode: str  # "none" (rendered, never read as calls) | "auto" | "required" | "named"
    named: str | None  # the function a named tool_choice calls
    parallel: bool
    call_format: CallFormat
    template_has_tools: bool  # the chat template renders `tools` itself

    @classmethod
    def of(cls, body, tokenizer) -> ChatTools | None:
        """None when the request has no tools."""
        if not body.tools:
            if body.tool_choice not in (None, "none"):
                raise ApiError.invalid("tool_choice: the request has no tools to choose from", "tool_choice")
            return None
        mode, named = body.tool_mode
        names = [tool.function.name for tool in body.tools]
        if len(set(names)) < len(names):
            raise ApiError.invalid("tools: two tools have the same name", "tools")
        if named is not None and named not in names:
            raise ApiError.invalid(f"tool_choice: no tool is named {named!r}", "tool_choice")
        template = tokenizer.chat_template
        return cls(body.tools, mode, named, body.parallel_tool_calls, call_format_for_template(template),
                   template_has_tools=bool(template) and "tools" in template)

    @property
    def names(self) -> set[str]:
        return {tool.function.name for tool in self.tools}

    @property
    def reads_calls(self) -> bool:
        """Whether replies are read for calls (not with tool_choice "none": then they are text)."""
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def template_tools(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def instructions(self) -> str:
        """The system text that asks a model whose template has no tool format for a JSON call."""
        functions = "\n".join(json.dumps(tool.function.model_dump(exclude_none=True, exclude={"strict"}))
                              for tool in self.tools)
        return _CALL_INSTRUCTIONS.format(functions=functions)

    def grammar(self, compiler: GrammarCompiler, tokenizer) -> Grammar | None:
        """Checks every tool's schema (a 400 names the tool and what the library refused); the grammar
        a required or named call is decoded under, else None. Call it off the event loop."""
        schemas = {}
        for index, tool in enumerate(self.tools):
            function = tool.function
            try:
                compiler.json_schema(function.parameters, strict=bool(function.strict))
            except UnsupportedGrammar as exc:
                raise ApiError.invalid(f"tools.{index}: the parameters of function {function.name!r} cannot be used "
                                       f"for constrained decoding: {exc}",
                                       f"tools.{index}.function.parameters") from None
            schemas[function.name] = self.call_format.call_schema(function.name, function.parameters)
        if not self.forced:
            return None
        names = [self.named] if self.named else list(schemas)
        chosen = [schemas[name] for name in names]
        strict = any(tool.function.strict for tool in self.tools if tool.function.name in names)
        added = tokenizer.get_added_vocab()

        def literal(text: str) -> str:  # a family's marker that is one token of its own is that token
            return f"<[{added[text]}]>" if text in added else json.dumps(text)

        return compiler.lark(self.call_format.grammar(chosen, self.parallel, strict, literal))


@dataclass
class ReadCall:
    """A call read from a reply: its id (made here, as OpenAI's), its function, its arguments sent so far."""

    id: str
    name: str
    arguments_sent: str = ""

    @classmethod
    def new(cls, name: str) -> ReadCall:
        return cls(f"call_{uuid.uuid4().hex[:24]}", name)


@dataclass
class ToolCallReader:
    """One choice's reply, fed as its text arrives, as deltas: ("content", text), ("call", index, id,
    name) and ("arguments", index, text).

    Constrained (required, named): the reply is calls, so each call's name goes out as soon as it is
    written and its arguments as they come (the JSON text as the model wrote it). Auto: text goes out
    as content until it could be the start of calls; from there it is held to the end, then sent as
    calls if it parses as calls (their arguments as compact JSON), else as content."""

    tools: ChatTools
    text: str = ""
    held_from: int | None = None  # auto: where the held text starts
    sent: int = 0  # auto: the text sent as content
    calls: list[ReadCall] = field(default_factory=list)

    def add(self, text: str) -> list[tuple]:
        self.text += text
        if self.tools.forced:
            return self._stream_calls()
        if self.held_from is None:
            self.held_from = self._call_start()
        end = len(self.text) if self.held_from is None else self.held_from
        return self._content(end)

    def finish(self) -> list[tuple]:
        if self.tools.forced:
            deltas = self._stream_calls()
            if self.calls:
                return deltas
            self.held_from = 0  # no call could be read as it came (cut short at its start): read it whole
        if self.held_from is None:
            return self._content(len(self.text))
        parsed = self.tools.call_format.parse(self.text[self.held_from:], self.tools.names)
        if parsed is None:
            return self._content(len(self.text))
        deltas = []
        for name, arguments in parsed[1]:
            deltas += self._announce(name)
            deltas.append(("arguments", len(self.calls) - 1, json.dumps(arguments, separators=(",", ":"),
                                                                        ensure_ascii=False)))
        return deltas

    def _content(self, end: int) -> list[tuple]:
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return [("content", piece)] if piece else []

    def _call_start(self) -> int | None:
        """Where calls could start in the text (None: nowhere yet). Only a family that writes text
        before its calls (Qwen) looks past the reply's start, then for its marker or a start of it."""
        call_format = self.tools.call_format
        if call_format.text_before_calls:
            marker = call_format.markers[0]
            found = self.text.find(marker, self.sent)
            if found >= 0:
                return found
            for length in range(min(len(marker) - 1, len(self.text)), 0, -1):
                if self.text.endswith(marker[:length]):
                    return len(self.text) - length
            return None
        if self.sent:
            return None  # content went out: this reply is text
        stripped = self.text.lstrip()
        opens = call_format.opens + (tuple(self.tools.names) if call_format.opens_with_name else ())
        return 0 if any(start.startswith(stripped) or stripped.startswith(start) for start in opens) else None

    def _announce(self, name: str) -> list[tuple]:
        self.calls.append(ReadCall.new(name))
        return [("call", len(self.calls) - 1, self.calls[-1].id, name)]

    def _stream_calls(self) -> list[tuple]:
        """The constrained reply's calls so far: names once written, then arguments as they grow."""
        deltas, position, index = [], 0, 0
        while (call := self.tools.call_format.next_call(self.text, position)) is not None:
            name, arguments_start = call
            if index == len(self.calls):
                deltas += self._announce(name)
            arguments_end = _value_end(self.text, arguments_start)
            arguments = self.text[arguments_start:arguments_end]
            call = self.calls[index]
            if len(arguments) > len(call.arguments_sent):
                deltas.append(("arguments", index, arguments[len(call.arguments_sent):]))
                call.arguments_sent = arguments
            if arguments_end == len(self.text):
                break
            position, index = arguments_end, index + 1
        return deltas


def _value_end(text: str, start: int) -> int:
    """Where the JSON value starting at text[start] ends (len(text) if it has not ended yet)."""
    depth, in_string, escaped = 0, False, False
    for position in range(start, len(text)):
        char = text[position]
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
    return len(text)
