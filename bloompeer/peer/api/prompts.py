"""From an OpenAI request to the token ids generate() starts from.

Chat messages go through the tokenizer's chat template when it has one. Otherwise (BLOOM
checkpoints have none) they use one plain template (render_plain_chat): one line per message,
"System: ...", "User: ..." or "Assistant: ..." ("developer" counts as system, a tool's result
reads "Tool: ..."), then "Assistant:" for the model to continue, e.g. "User: Hello\nAssistant:".
Nothing is added to the stop sequences; pass `stop: ["\nUser:"]` to end the answer where the model
starts the user's next turn.

With tools (tools.py), a template that renders tools itself gets them, the conversation's tool calls
and results as it expects them; otherwise a system message lists the functions, an assistant's
calls read as the JSON it was asked to write, and a tool's result is a user message (a "Tool:" line
in the plain template).
"""

from __future__ import annotations

import json

from .errors import ApiError
from .openai_schema import ChatMessage
from .tools import ChatTools, conversation

__all__ = ["MAX_PROMPTS", "chat_prompt_ids", "check_prompt", "completion_prompts", "render_plain_chat"]

MAX_PROMPTS = 1024  # prompts in one completions request (each a choice, or n of them)

_ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def render_plain_chat(messages: list[tuple[str, str]]) -> str:
    lines = [f"{_ROLE_NAMES[role]}: {content}\n" for role, content in messages]
    return "".join(lines) + "Assistant:"


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], tools: ChatTools | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
    """template_kwargs: the request's chat_template_kwargs, variables the template reads (Qwen3's
    enable_thinking); the plain template has none."""
    turns = conversation(messages)
    template_kwargs = {key: value for key, value in (template_kwargs or {}).items()
                       if key not in ("tools", "add_generation_prompt", "tokenize", "messages", "conversation")}
    for turn in turns:
        if turn["role"] == "developer":
            turn["role"] = "system"
    template = tokenizer.chat_template
    if tools is not None and tools.template_has_tools:
        text = tokenizer.apply_chat_template(turns, tools=tools.template_tools(), add_generation_prompt=True,
                                             tokenize=False, **template_kwargs)
        return tokenizer(text, add_special_tokens=False).input_ids
    if tools is not None:
        turns = [{"role": "system", "content": tools.instructions()}, *turns]
    turns = [_without_tool_format(turn, plain=not template) for turn in turns]
    if template:
        text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False, **template_kwargs)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(render_plain_chat([(turn["role"], turn["content"]) for turn in turns])).input_ids


def _without_tool_format(turn: dict, plain: bool) -> dict:
    """A turn for a template with no tool format: calls as the JSON asked for, results as user text."""
    content = turn["content"]
    if turn.get("tool_calls"):
        calls = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
                 for call in turn["tool_calls"]]
        content = (content + "\n" if content else "") + "\n".join(json.dumps(call) for call in calls)
    if turn["role"] == "tool":
        return {"role": "tool", "content": content} if plain else \
            {"role": "user", "content": f"Result of {turn['name']}: {content}"}
    return {"role": turn["role"], "content": content}


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
