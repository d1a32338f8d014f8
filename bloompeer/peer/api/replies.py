"""How a chat choice's text becomes an assistant message: its reasoning, its content and its tool
calls, read as the text arrives so that a stream and a plain response say the same.

The chat template tells the family: gpt-oss's harmony channels (harmony.py), a `<think>` block
(reasoning.py, where the template writes one) and the family's tool call format (tools.py) read from
what follows the block. A constrained reply (response_format, a required or named call) is decoded
from its first token under its grammar, so it has no think block: it is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .harmony import HARMONY_MARKER, HarmonyReader
from .reasoning import THINK_OPEN, ThinkSplitter, think_start_state
from .tools import ChatTools, ReadCall, ToolCallReader

__all__ = ["ReadReply", "ReplyFormat", "ReplyReader", "read_whole"]

_PROMPT_TAIL_TOKENS = 16  # hold "</think>\n\n" (10 bytes) in any tokenizer: a token is at least a byte


@dataclass(frozen=True)
class ReplyFormat:
    """What a request's replies are read for."""

    tools: ChatTools | None  # None: no tools, or tool_choice none (replies are never calls)
    reasoning: str | None  # "think", "harmony" or None (the template has neither)
    think_start: str = "before"  # think_start_state of the prompt

    @classmethod
    def of(cls, tokenizer, prompt_ids: list[int], tools: ChatTools | None, constrained: bool) -> ReplyFormat:
        template = tokenizer.chat_template or ""
        tools = tools if tools is not None and tools.reads_calls else None
        if HARMONY_MARKER in template:
            return cls(tools, "harmony")
        if THINK_OPEN not in template:
            return cls(tools, None)
        tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return cls(tools, "think", "content" if constrained else think_start_state(tail))

    @property
    def plain(self) -> bool:
        """The reply is all content: no reader needed."""
        return self.tools is None and self.reasoning is None

    @property
    def special_tokens(self) -> bool:
        """Whether the text is decoded with its special tokens (harmony's markers are)."""
        return self.reasoning == "harmony"

    def reader(self) -> ReplyReader:
        if self.reasoning == "harmony":
            return HarmonyReader(self.tools)
        splitter = ThinkSplitter(self.think_start) if self.reasoning == "think" else None
        return ReplyReader(splitter, ToolCallReader(self.tools) if self.tools is not None else None)


@dataclass(frozen=True)
class ReadReply:
    """A whole reply, read: what a plain (not streamed) response says."""

    content: str
    reasoning: str
    calls: list[tuple[str, str, str]]  # (id, function name, arguments as JSON text)


def read_whole(reader, text: str) -> ReadReply:
    """`text`, the whole reply, through a fresh reader (ReplyReader or HarmonyReader)."""
    deltas = reader.add(text) + reader.finish()
    content = "".join(delta[1] for delta in deltas if delta[0] == "content")
    reasoning = "".join(delta[1] for delta in deltas if delta[0] == "reasoning")
    calls = [(call.id, call.name, "".join(delta[2] for delta in deltas if delta[0] == "arguments" and delta[1] == index))
             for index, call in enumerate(reader.calls)]
    return ReadReply(content, reasoning, calls)


@dataclass
class ReplyReader:
    """One choice's text in; ("reasoning", text), ("content", text), ("call", index, id, name) and
    ("arguments", index, text) deltas out: the think block split off first, calls read from the rest."""

    splitter: ThinkSplitter | None
    tool_reader: ToolCallReader | None
    no_calls: list[ReadCall] = field(default_factory=list)

    @property
    def calls(self) -> list[ReadCall]:
        return self.tool_reader.calls if self.tool_reader is not None else self.no_calls

    def add(self, text: str) -> list[tuple]:
        return self._read(self.splitter.add(text) if self.splitter is not None else [("content", text)])

    def finish(self) -> list[tuple]:
        deltas = self._read(self.splitter.finish()) if self.splitter is not None else []
        return deltas + (self.tool_reader.finish() if self.tool_reader is not None else [])

    def _read(self, parts: list[tuple[str, str]]) -> list[tuple]:
        deltas = []
        for kind, text in parts:
            if kind == "content" and self.tool_reader is not None:
                deltas += self.tool_reader.add(text)
            elif text:
                deltas.append((kind, text))
        return deltas
