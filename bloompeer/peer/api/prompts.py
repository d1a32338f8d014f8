"""From an OpenAI request to the token ids generate() starts from.

Chat messages go through the tokenizer's chat template when it has one. Otherwise (BLOOM
checkpoints have none) they use one plain template (render_plain_chat): one line per message,
"System: ...", "User: ..." or "Assistant: ..." ("developer" counts as system), then "Assistant:"
for the model to continue, e.g. "User: Hello\nAssistant:". Nothing is added to the stop sequences; pass
`stop: ["\nUser:"]` to end the answer where the model starts the user's next turn.
"""

from __future__ import annotations

from .errors import ApiError
from .openai_schema import ChatMessage

__all__ = ["chat_prompt_ids", "check_prompt", "completion_prompt_ids",
           "render_plain_chat"]

_ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}


def render_plain_chat(messages: list[tuple[str, str]]) -> str:
    lines = [f"{_ROLE_NAMES[role]}: {content}\n" for role, content in messages]
    return "".join(lines) + "Assistant:"


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    try:
        pairs = [(message.role, message.text()) for message in messages]
    except ValueError as exc:
        raise ApiError.invalid(str(exc), "messages") from None
    if tokenizer.chat_template:
        role_of = {"developer": "system"}
        text = tokenizer.apply_chat_template([{"role": role_of.get(role, role), "content": content}
                                              for role, content in pairs], add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(render_plain_chat(pairs)).input_ids


def completion_prompt_ids(tokenizer, prompt: str | list[str] | list[int], vocab_size: int) -> list[int]:
    """A prompt is text, a list holding one text, or token ids (one prompt per request)."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, int) for item in prompt):
        if not all(0 <= item < vocab_size for item in prompt):
            raise ApiError.invalid(f"prompt: token ids must be in 0..{vocab_size - 1}", "prompt")
        return list(prompt)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError.invalid(f"prompt: one prompt per request, got {len(prompt)}", "prompt")
        prompt = prompt[0]
    return tokenizer(prompt).input_ids


def check_prompt(prompt_ids: list[int]) -> None:
    """What the API checks itself; the swarm's limits (tokens per session, per request) are checked
    by the client's routing against what the servers announce (a 400 naming the limit)."""
    if not prompt_ids:
        raise ApiError.invalid("the prompt is empty: give at least one token", "prompt")
