"""A thinking model's reasoning apart from its answer: Qwen3's (and DeepSeek-R1's) `<think>...</think>`
block, read from a choice's text as it arrives.

Where the reply starts is read from the end of its prompt, as the chat template wrote it:
- the prompt ends with `<think>` (Qwen3-Thinking's and DeepSeek-R1's templates open the block): the
  reply starts as reasoning, until `</think>`;
- the prompt ends with `</think>` (Qwen3's with `enable_thinking` false writes an empty block): the
  reply is all content, a `<think>` in it included;
- else (Qwen3's, thinking on): content until the first `<think>`, reasoning until `</think>`, then
  content.
No text is lost: a block cut short by max_tokens is reasoning, text before `<think>` is content, a
partial marker at the end is the text it is. Only the markers and the whitespace that separates
them from the text (the newlines the models write around them) are left out.

gpt-oss writes its reasoning in harmony's analysis channel instead (harmony.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["THINK_CLOSE", "THINK_OPEN", "ThinkSplitter", "marker_start", "think_start_state"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def think_start_state(prompt_tail: str) -> str:
    """"reasoning", "content" (no block will be read) or "before" (a block may open), from the text
    that ends the prompt."""
    tail = prompt_tail.rstrip()
    if tail.endswith(THINK_OPEN):
        return "reasoning"
    if tail.endswith(THINK_CLOSE):
        return "content"
    return "before"


@dataclass
class ThinkSplitter:
    """One choice's text in, ("reasoning", text) and ("content", text) deltas out.

    state: "before" (content; a `<think>` opens the block), "reasoning", "after" (content after the
    block) or "content" (all content). Text that may be the start of a marker, or whitespace that may
    turn out to touch one, is held until the next text or finish() decides it."""

    state: str = "before"
    held: str = ""
    skip_space: bool = False  # drop the whitespace that starts the next text (it follows a marker)

    def __post_init__(self):
        self.skip_space = self.state == "reasoning"

    def add(self, text: str) -> list[tuple[str, str]]:
        text, self.held = self.held + text, ""
        deltas = []
        while text:
            if self.skip_space:
                text = text.lstrip()
                if not text:
                    return deltas
                self.skip_space = False
            if self.state in ("content", "after"):
                return deltas + [("content", text)]
            marker = THINK_OPEN if self.state == "before" else THINK_CLOSE
            kind = "content" if self.state == "before" else "reasoning"
            found = text.find(marker)
            if found < 0:
                keep = len(text[:marker_start(text, marker)].rstrip())  # whitespace may touch a marker
                self.held = text[keep:]
                return deltas + ([(kind, text[:keep])] if keep else [])
            before = text[:found].rstrip()
            if before:
                deltas.append((kind, before))
            text = text[found + len(marker):]
            self.state, self.skip_space = ("reasoning" if self.state == "before" else "after"), True
        return deltas

    def finish(self) -> list[tuple[str, str]]:
        """The held text, as what it turned out to be: the end of the reply."""
        held, self.held = self.held, ""
        if not held or (self.skip_space and not held.strip()):
            return []
        return [("reasoning" if self.state == "reasoning" else "content", held)]


def marker_start(text: str, *markers: str) -> int:
    """Where the longest end of `text` that is a start of one of `markers` begins (len(text) if none)."""
    for length in range(min(max(len(marker) for marker in markers) - 1, len(text)), 0, -1):
        if any(text.endswith(marker[:length]) for marker in markers if length < len(marker)):
            return len(text) - length
    return len(text)
