"""gpt-oss's replies (OpenAI's harmony format), read as they arrive: reasoning, content and tool calls.

A reply is a run of messages, each a header then `<|message|>` and its text, ended by `<|end|>`
(another message follows, after `<|start|>assistant`), or by `<|call|>` or `<|return|>` (the
model's end-of-text tokens). The chat template's generation prompt ends with `<|start|>assistant`,
so the reply starts with the first header:

    <|channel|>analysis<|message|>The user asks...<|end|>            reasoning
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>   content
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
                                                                      a call of get_weather
    <|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{...}<|call|>
                                                                      the same, as the template writes it

A message on the commentary channel with no recipient (a preamble the user may see) is content; so
is text outside any message (a reply constrained to JSON has no header) and a message to a
recipient that is no function of the request. Under tool_choice auto a call's arguments are held
until its message ends and sent only if they are a JSON object (else its text is content, as
tools.py does for the other families); a required or named call was constrained to its schema, so
its arguments stream as they come. The markers are special tokens, so these replies are decoded
with special tokens kept (GenerationRequest.special_tokens).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .reasoning import marker_start
from .tools import ChatTools, ReadCall

__all__ = ["HARMONY_MARKER", "HarmonyReader"]

HARMONY_MARKER = "<|channel|>"  # what tells a harmony chat template
_START, _MESSAGE, _END = "<|start|>", "<|message|>", "<|end|>"
_ENDS = (_END, "<|call|>", "<|return|>", "<|endoftext|>", _START)  # what ends a message's text
_HEADER_STARTS = ("<|channel|>", " to=", "to=")  # how the reply's first header may begin
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass
class HarmonyReader:
    """One choice's text in; ("reasoning", text), ("content", text), ("call", index, id, name) and
    ("arguments", index, text) out, as ToolCallReader's. tools: None if replies are not read for calls."""

    tools: ChatTools | None
    state: str = "first"  # "first" (the reply's start), "header", "body", "loose" (outside any message)
    kind: str = "content"  # the body's: "reasoning", "content" or "call"
    text: str = ""  # not yet handed out: the header so far, a held call's arguments, a partial marker
    calls: list[ReadCall] = field(default_factory=list)
    call_name: str = ""

    def add(self, text: str) -> list[tuple]:
        self.text += text
        deltas = []
        while True:
            step = self._step()
            if step is None:
                return deltas
            deltas += step

    def finish(self) -> list[tuple]:
        """What is left, now that the reply has ended: an unended message ends here."""
        deltas = self.add("")
        rest, self.text = self.text, ""
        if self.state == "body":
            return deltas + self._body_end(rest)
        return deltas + ([("content", rest)] if rest else [])

    def _step(self) -> list[tuple] | None:
        """Consume what the text so far decides; None when more text is needed."""
        if self.state == "first":
            if self.text.startswith(_HEADER_STARTS):
                self.state = "header"
            elif any(start.startswith(self.text) for start in _HEADER_STARTS):
                return None  # "" or a start of a header: more text decides
            else:
                self.state = "loose"
            return []
        if self.state == "header":
            found = self.text.find(_MESSAGE)
            if found < 0:
                return None
            header, self.text = self.text[:found], self.text[found + len(_MESSAGE):]
            self.state = "body"
            return self._body_start(header)
        return self._body_text()

    def _body_start(self, header: str) -> list[tuple]:
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = recipient.group(1).removeprefix("functions.") if recipient else ""
        if recipient and self.tools is not None and recipient.group(1).startswith("functions.") \
                and name in self.tools.names:
            self.kind, self.call_name = "call", name
            return self._announce() if self.tools.forced else []
        self.kind = "reasoning" if channel and channel.group(1) == "analysis" and not recipient else "content"
        return []

    def _announce(self) -> list[tuple]:
        self.calls.append(ReadCall.new(self.call_name))
        return [("call", len(self.calls) - 1, self.calls[-1].id, self.call_name)]

    def _body_text(self) -> list[tuple] | None:
        """The text of the message (or loose text) up to its end marker, or as much as is decided."""
        ends = [(found, marker) for marker in _ENDS if (found := self.text.find(marker)) >= 0]
        if not ends:
            keep = marker_start(self.text, *_ENDS)
            if self.kind == "call" and not self.tools.forced and self.state == "body":
                return None  # auto: a call's arguments are read whole
            piece, self.text = self.text[:keep], self.text[keep:]
            return self._piece(piece) if piece else None
        found, marker = min(ends)
        piece, self.text = self.text[:found], self.text[found + len(marker):]
        deltas = self._body_end(piece) if self.state == "body" else ([("content", piece)] if piece else [])
        self.state, self.kind = ("header" if marker == _START else "loose"), "content"
        return deltas

    def _piece(self, piece: str) -> list[tuple]:
        if self.state == "loose":
            return [("content", piece)]
        if self.kind == "call":
            self.calls[-1].arguments_sent += piece
            return [("arguments", len(self.calls) - 1, piece)]
        return [(self.kind, piece)]

    def _body_end(self, piece: str) -> list[tuple]:
        """The last text of a message; a held call's arguments are sent, or its text as content."""
        if self.kind != "call" or self.tools.forced:
            return self._piece(piece) if piece else []
        try:
            arguments = json.loads(piece)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            return [("content", piece)] if piece else []
        return self._announce() + [("arguments", len(self.calls) - 1,
                                    json.dumps(arguments, separators=(",", ":"), ensure_ascii=False))]
