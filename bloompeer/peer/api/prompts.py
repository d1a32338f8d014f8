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

__all__ = ["MAX_PROMPTS", "chat_prompt_ids", "check_prompt", "completion_prompts", "render_plain_chat"]

MAX_PROMPTS = 1024  # prompts in one completions request (each a choice, or n of them)

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


def completion_prompts(tokenizer, prompt: str | list[str] | list[int] | list[list[int]],
                       vocab_size: int) -> list[list[int]]:
    """The token ids of each prompt: one text, several texts, one token-id list, or several."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif not prompt:
        raise ApiError.invalid("prompt: the list of prompts is empty", "prompt")
    elif isinstance(prompt[0], int):
        prompts = [prompt]
    else:
        prompts = prompt
    if len(prompts) > MAX_PROMPTS:
        raise ApiError.invalid(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    return [_prompt_ids(tokenizer, item, vocab_size) for item in prompts]


def _prompt_ids(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids
    elif not all(0 <= item < vocab_size for item in prompt):
        raise ApiError.invalid(f"prompt: token ids must be in 0..{vocab_size - 1}", "prompt")
    else:
        ids = list(prompt)
    check_prompt(ids)
    return ids


def check_prompt(prompt_ids: list[int]) -> None:
    """What the API checks itself; the swarm's limits (tokens per session, per request) are checked
    by the client's routing against what the servers announce (a 400 naming the limit)."""
    if not prompt_ids:
        raise ApiError.invalid("the prompt is empty: give at least one token", "prompt")
