"""How each model family writes tool calls in its replies: how a reply's calls are found (parse),
and the grammar a reply must follow when it has to call (`tool_choice` required or named).

    qwen     Qwen2.5/Qwen3 (Hermes style): text, then <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
             blocks, one per call
    llama3   Llama 3.1+: the whole reply is {"name": ..., "parameters": {...}} (after <|python_tag|>,
             if the model writes it); several calls separated by ";"
    mistral  Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    mistral_args  Mistral's newer templates (Small 3.2, Magistral, Devstral): [TOOL_CALLS]NAME[ARGS]{...}
             per call ([CALL_ID]ID before [ARGS] in some); where the markers are special tokens the
             text holds NAME{...}, which reads the same
    harmony  gpt-oss: a message to the function, <|channel|>commentary to=functions.NAME <|constrain|>json
             <|message|>{...arguments} (read by harmony.py, with the reply's other channels)
    json     a checkpoint whose chat template has no tool format (the demo model, BLOOM): the
             whole reply is {"name": ..., "arguments": {...}}, as tools.py's prompt asks for

A family is recognised by its chat template's markers. A reply is taken as calls only if every
call in it parses, names a tool of the request and has an object for arguments; anything else
stays text, so a reply that merely looks like a call never loses its text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CallFormat", "ParsedCall", "call_format_for_template", "CALL_FORMATS"]

ParsedCall = tuple[str, dict[str, Any]]  # (function name, arguments)
_JSON_OPTIONS = {"whitespace_flexible": False}  # as response_format's JSON (constrained.py)


@dataclass(frozen=True)
class CallFormat:
    name: str
    arguments_key: str = "arguments"  # what the family calls a call's arguments
    markers: tuple[str, ...] = ()  # text that starts the calls ("" entries: a reply that is only JSON)
    opens: tuple[str, ...] = ()  # how a reply of calls may begin (a stream holds such text until it ends)
    text_before_calls: bool = False  # the family may write text before its calls
    before: tuple[str, ...] = ()  # written before the calls (each piece may be a special token)
    between: str = ""  # written between two calls
    after: str = ""  # written after the calls
    call_prefix: str = ""  # written before each call
    call_suffix: str = ""  # written after each call
    parallel: bool = True  # the format has room for several calls
    opens_with_name: bool = False  # a reply of calls may begin with a tool's name (its marker a special token)

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one call of function `name`: its name first, then its arguments."""
        return {"type": "object", "properties": {"name": {"const": name}, self.arguments_key: parameters},
                "required": ["name", self.arguments_key], "additionalProperties": False}

    def grammar(self, call_schemas: list[dict[str, Any]], parallel: bool, strict: bool,
                literal: Callable[[str], str] = json.dumps) -> str:
        """A Lark grammar (llguidance's) of a reply that makes one call (or, if `parallel` and the
        format has room, several) of one of the schemas, written without whitespace. strict: as
        GrammarCompiler.json_schema's. literal(text): `text` as a Lark terminal (a special token,
        where the tokenizer has one for it)."""
        schema = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
        schema = {**schema, "x-guidance": {**_JSON_OPTIONS, "lenient": not strict}}  # read at the top only
        call = " ".join(part for part in (self._text(self.call_prefix, literal), "body",
                                          self._text(self.call_suffix, literal)) if part)
        many = f' ({self._text(self.between, literal)} call)*' if parallel and self.parallel else ""
        start = " ".join(part for part in (*(literal(piece) for piece in self.before), "call" + many,
                                           self._text(self.after, literal)) if part)
        return f"start: {start}\ncall: {call}\nbody: %json {json.dumps(schema)}\n"

    @staticmethod
    def _text(text: str, literal: Callable[[str], str]) -> str:
        return literal(text) if text else ""

    def next_call(self, text: str, position: int) -> tuple[str, int] | None:
        """In a constrained reply as it is written: the next call from `position` on, as (its
        function's name, where its arguments begin) once both are written; None until then."""
        start = text.find('{"name":"', position)
        name_end = text.find('"', start + 9) if start >= 0 else -1
        prefix = f",{json.dumps(self.arguments_key)}:"
        if name_end < 0 or not text.startswith(prefix, name_end + 1):
            return None
        return text[start + 9:name_end], name_end + 1 + len(prefix)

    def parse(self, text: str, tool_names: set[str]) -> tuple[str, list[ParsedCall]] | None:
        """(the text before the calls, the calls) if the reply makes calls, else None."""
        content, calls_text = self._split(text)
        if calls_text is None:
            return None
        calls = [_call(item, self.arguments_key, tool_names) for item in self._items(calls_text)]
        if not calls or any(call is None for call in calls):
            return None
        return content, calls

    def _split(self, text: str) -> tuple[str, str | None]:
        """(text before the calls, the calls' text) or (text, None) where no call starts."""
        stripped = text.strip()
        for marker in self.markers:
            if stripped.startswith(marker):
                return "", stripped[len(marker):]
        return text, None

    def _items(self, calls_text: str) -> list[Any]:
        """The calls' JSON values, or [None] where they do not parse."""
        return [_json(calls_text)]


class _JsonCalls(CallFormat):
    def _items(self, calls_text: str) -> list[Any]:
        value = _json(calls_text)
        return value if isinstance(value, list) else [value]


class _LlamaCalls(CallFormat):
    def _items(self, calls_text: str) -> list[Any]:
        value = _json(calls_text)
        if value is not None:
            return [value]
        return [_json(part) for part in calls_text.split(";")]  # several calls: "{...}; {...}"


class _QwenCalls(CallFormat):
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def _split(self, text: str) -> tuple[str, str | None]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, None
        return text[:start].strip(), text[start:]

    def _items(self, calls_text: str) -> list[Any]:
        blocks = self._BLOCK.findall(calls_text)
        if self._BLOCK.sub("", calls_text).strip():  # text between or after the blocks, or an unclosed one
            return [None]
        return [_json(block) for block in blocks]


class _MistralCalls(CallFormat):
    def _items(self, calls_text: str) -> list[Any]:
        value = _json(calls_text)
        return value if isinstance(value, list) else [None]


class _MistralArgsCalls(CallFormat):
    _CALL = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?")
    _WRITTEN_CALL = re.compile(_CALL.pattern + r"(?=\{)")  # its name is whole once its arguments begin

    def next_call(self, text: str, position: int) -> tuple[str, int] | None:
        header = self._WRITTEN_CALL.match(text, position)
        return None if header is None else (header.group(1), header.end())

    def parse(self, text: str, tool_names: set[str]) -> tuple[str, list[ParsedCall]] | None:
        calls, position, decoder = [], 0, json.JSONDecoder()
        while position < len(text.rstrip()):
            header = self._CALL.match(text, position)
            if header is None or header.group(1) not in tool_names:
                return None
            try:
                arguments, position = decoder.raw_decode(text, header.end())
            except ValueError:
                return None
            if not isinstance(arguments, dict):
                return None
            calls.append((header.group(1), arguments))
        return ("", calls) if calls else None

    def grammar(self, call_schemas: list[dict[str, Any]], parallel: bool, strict: bool,
                literal: Callable[[str], str] = json.dumps) -> str:
        """[TOOL_CALLS]NAME[ARGS]{arguments}, once (or, if parallel, again and again)."""
        return _named_calls(call_schemas, self.arguments_key, strict, "+" if parallel else "",
                            lambda name: f'{literal("[TOOL_CALLS]")} {json.dumps(name)} {literal("[ARGS]")}')


class _HarmonyCalls(CallFormat):
    """Read by harmony.py's HarmonyReader (never by parse); here for the grammar of a required call."""

    def grammar(self, call_schemas: list[dict[str, Any]], parallel: bool, strict: bool,
                literal: Callable[[str], str] = json.dumps) -> str:
        """One message to one of the functions (the name is its header's, the arguments its text)."""
        return _named_calls(call_schemas, self.arguments_key, strict, "", lambda name: (
            f'{literal("<|channel|>")} {json.dumps(f"commentary to=functions.{name} ")} {literal("<|constrain|>")} '
            f'"json" {literal("<|message|>")}'))


def _named_calls(call_schemas: list[dict[str, Any]], arguments_key: str, strict: bool, repeat: str,
                 header: Callable[[str], str]) -> str:
    """A Lark grammar of calls whose function is named by a header (header(name): its Lark text) and whose
    arguments follow it as JSON; repeat: "" (one call) or "+" (one or more)."""
    rules = []
    for index, schema in enumerate(call_schemas):
        arguments = {**schema["properties"][arguments_key], "x-guidance": {**_JSON_OPTIONS, "lenient": not strict}}
        rules.append(f"call{index}: {header(schema['properties']['name']['const'])} body{index}\n"
                     f"body{index}: %json {json.dumps(arguments)}")
    calls = " | ".join(f"call{index}" for index in range(len(call_schemas)))
    return f"start: ({calls}){repeat}\n" + "\n".join(rules) + "\n"


CALL_FORMATS = {
    "json": _JsonCalls("json", markers=("",), opens=("{",), parallel=False),
    "qwen": _QwenCalls("qwen", markers=("<tool_call>",), opens=("<tool_call>",), text_before_calls=True,
                       between="\n", call_prefix="<tool_call>\n", call_suffix="\n</tool_call>"),
    "llama3": _LlamaCalls("llama3", arguments_key="parameters", markers=("<|python_tag|>", ""),
                          opens=("<|python_tag|>", "{"), parallel=False),
    "mistral": _MistralCalls("mistral", markers=("[TOOL_CALLS]", ""), opens=("[TOOL_CALLS]", "["),
                             before=("[TOOL_CALLS]", "["), between=",", after="]"),
    "mistral_args": _MistralArgsCalls("mistral_args", markers=("[TOOL_CALLS]",), opens=("[TOOL_CALLS]",),
                                      opens_with_name=True),
    "harmony": _HarmonyCalls("harmony", parallel=False),
}


def call_format_for_template(template: str | None) -> CallFormat:
    """The family format a chat template writes tool calls in (json if it has none)."""
    if not template or "tools" not in template:
        return CALL_FORMATS["json"]
    if "<|channel|>" in template:
        return CALL_FORMATS["harmony"]
    if "<tool_call>" in template:
        return CALL_FORMATS["qwen"]
    if "[TOOL_CALLS]" in template:
        return CALL_FORMATS["mistral_args" if "[ARGS]" in template else "mistral"]
    if "<|python_tag|>" in template or "ipython" in template:
        return CALL_FORMATS["llama3"]
    return CALL_FORMATS["json"]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(item: Any, arguments_key: str, tool_names: set[str]) -> ParsedCall | None:
    if not isinstance(item, dict) or item.get("name") not in tool_names:
        return None
    arguments = item.get(arguments_key, item.get("arguments", item.get("parameters")))
    if isinstance(arguments, str):
        arguments = _json(arguments)
    return (item["name"], arguments) if isinstance(arguments, dict) else None
