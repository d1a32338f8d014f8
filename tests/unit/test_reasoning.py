"""Reasoning apart from the answer (bloompeer/peer/api/reasoning.py, harmony.py, replies.py), with no
model: what a family's own chat template writes for an assistant turn (its thinking, its answer, its
tool calls) is read back as reasoning_content, content and tool calls; read a character at a time it
adds up to the same; no text is lost where a reply is cut short or merely looks like the format.

The templates are the families' own, abridged to what renders an assistant turn and the generation
prompt (tests never download a checkpoint): Qwen3's (its think block, `enable_thinking`, its
<tool_call> blocks) and gpt-oss's harmony template (transformers' conversion script's, 4.55).
"""

from __future__ import annotations

import json
import random

import llguidance
import pytest
from transformers import AutoTokenizer

from bloompeer.peer.api.constrained import GrammarCompiler
from bloompeer.peer.api.openai_schema import ChatCompletionRequest
from bloompeer.peer.api.replies import ReplyFormat, read_whole
from bloompeer.peer.api.tools import ChatTools
from bloompeer.peer.cli.default_model import write_byte_tokenizer

QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning_content = message.reasoning_content if message.reasoning_content is string else '' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "message.content.lstrip('\\n') }}"
    "{%- for tool_call in message.tool_calls or [] %}{% set tool_call = tool_call.function %}"
    "{%- if (loop.first and message.content) or (not loop.first) %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if tools %}{# <tool_call> #}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
HARMONY = (
    "{#- Valid channels: analysis, commentary, final. Calls to these tools must go to the commentary channel #}"
    "{%- set last_tool_call = namespace(name=none) %}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.thinking %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant to=' }}{{- 'functions.' + tool_call.name + '<|channel|>commentary ' }}"
    "{{- (tool_call.content_type if tool_call.content_type is defined else 'json') + '<|message|>' }}"
    "{{- tool_call.arguments|tojson }}{{- '<|call|>' }}{%- set last_tool_call.name = tool_call.name %}"
    "{%- else %}{%- if 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}{%- endif %}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|start|>functions.' + last_tool_call.name }}"
    "{{- ' to=assistant<|channel|>commentary<|message|>' + message.content|tojson + '<|end|>' }}"
    "{%- elif message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
USER = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bytes")
    write_byte_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)


def _format(tokenizer, template: str, tools: list | None = None, tool_choice="auto", constrained=False,
            **template_kwargs) -> ReplyFormat:
    tokenizer.chat_template = template
    prompt = tokenizer.apply_chat_template([USER], tools=tools, add_generation_prompt=True, tokenize=False,
                                           **template_kwargs)
    body = ChatCompletionRequest(model="m", messages=[USER], tools=tools, tool_choice=tool_choice if tools else None)
    return ReplyFormat.of(tokenizer, tokenizer(prompt, add_special_tokens=False).input_ids,
                          ChatTools.of(body, tokenizer), constrained)


def _turn(tokenizer, template: str, assistant: dict, tools: list | None = None) -> str:
    """What the template writes after its generation prompt for this assistant turn (the reply)."""
    before = tokenizer.apply_chat_template([USER], tools=tools, chat_template=template, tokenize=False,
                                           add_generation_prompt=True)
    after = tokenizer.apply_chat_template([USER, assistant], tools=tools, chat_template=template, tokenize=False)
    assert after.startswith(before)
    return after[len(before):]


def _read(reply_format: ReplyFormat, text: str, pieces: int = 0, seed: int = 0):
    """The reply read whole, and read in `pieces` random pieces (0: a character at a time): the same."""
    whole = read_whole(reply_format.reader(), text)
    cuts = sorted(random.Random(seed).sample(range(1, len(text)), pieces)) if pieces else range(1, len(text))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    reader, deltas = reply_format.reader(), []
    for part in parts:
        deltas += reader.add(part)
    deltas += reader.finish()
    streamed = {kind: "".join(d[1] for d in deltas if d[0] == kind) for kind in ("content", "reasoning")}
    assert streamed == {"content": whole.content, "reasoning": whole.reasoning}
    assert [d[3] for d in deltas if d[0] == "call"] == [name for _, name, _ in whole.calls]
    return whole


@pytest.mark.parametrize("reasoning, content", [("The user asks about Paris.\nCheck.", "It is sunny."),
                                                ("", "Hi"), ("Hmm", "")])
def test_qwen3s_think_block_is_read_back(tokenizer, reasoning, content):
    reply_format = _format(tokenizer, QWEN3)
    assert (reply_format.reasoning, reply_format.think_start) == ("think", "before")
    turn = _turn(tokenizer, QWEN3, {"role": "assistant", "content": content, "reasoning_content": reasoning})
    reply = _read(reply_format, turn[:turn.index("<|im_end|>")])
    assert (reply.reasoning, reply.content, reply.calls) == (reasoning, content, [])
    for seed in range(5):
        _read(reply_format, turn, pieces=3, seed=seed)


def test_qwen3s_think_block_then_a_tool_call(tokenizer):
    reply_format = _format(tokenizer, QWEN3, tools=[WEATHER])
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    turn = _turn(tokenizer, QWEN3, {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                                    "tool_calls": [call]}, tools=[WEATHER])
    reply = _read(reply_format, turn[:turn.index("<|im_end|>")])
    assert reply.reasoning == "Use the tool." and reply.content == ""
    assert [(name, json.loads(arguments)) for _, name, arguments in reply.calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>\nStill thinking about", "Still thinking about", ""),  # cut by max_tokens: reasoning
    ("Well. <think>why</think>\n\nSo.", "why", "Well.So."),  # text before the block is content
    ("<think>a</thi", "a</thi", ""),  # a partial marker at the end is text
    ("No block at all <thin", "", "No block at all <thin"),
    ("<think>a</think>b<think>c</think>", "a", "b<think>c</think>"),  # one block; the rest is content
    ("  \n", "", "  \n"),
])
def test_no_text_is_lost(tokenizer, text, reasoning, content):
    reply = _read(_format(tokenizer, QWEN3), text)
    assert (reply.reasoning, reply.content) == (reasoning, content)


def test_with_enable_thinking_false_there_is_no_think_block(tokenizer):
    reply_format = _format(tokenizer, QWEN3, enable_thinking=False)
    assert reply_format.think_start == "content"
    assert _read(reply_format, "<think>x</think>y") == read_whole(reply_format.reader(), "<think>x</think>y")
    assert _read(reply_format, "<think>x</think>y").content == "<think>x</think>y"


def test_a_template_that_opens_the_block_starts_the_reply_in_it(tokenizer):
    """Qwen3-Thinking's and DeepSeek-R1's generation prompts end with "<think>\\n"."""
    reply_format = _format(tokenizer, QWEN3.replace("'<|im_start|>assistant\\n' }}{%- if enable",
                                                    "'<|im_start|>assistant\\n<think>\\n' }}{%- if enable"))
    assert reply_format.think_start == "reasoning"
    assert _read(reply_format, "Let me see.\n</think>\n\nSunny.").reasoning == "Let me see."
    assert _read(reply_format, "Let me see.\n</think>\n\nSunny.").content == "Sunny."
    constrained = _format(tokenizer, QWEN3, constrained=True)  # a grammar decodes the reply from its first token
    assert constrained.think_start == "content"


def test_gpt_oss_analysis_and_final_channels(tokenizer):
    reply_format = _format(tokenizer, HARMONY)
    assert reply_format.reasoning == "harmony" and reply_format.special_tokens
    turn = _turn(tokenizer, HARMONY, {"role": "assistant", "content": "It is sunny.", "thinking": "Paris, June."})
    assert turn.startswith("<|channel|>analysis<|message|>")  # the generation prompt ends with <|start|>assistant
    reply = _read(reply_format, turn)
    assert (reply.reasoning, reply.content, reply.calls) == ("Paris, June.", "It is sunny.", [])


@pytest.mark.parametrize("form", ["template", "model"])
def test_gpt_oss_calls_are_tool_calls(tokenizer, form):
    """As the template writes a call (recipient before the channel) and as the model writes it."""
    reply_format = _format(tokenizer, HARMONY, tools=[WEATHER])
    if form == "template":
        call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        turn = _turn(tokenizer, HARMONY, {"role": "assistant", "content": "", "thinking": "Call it.",
                                          "tool_calls": [call]}, tools=[WEATHER])
    else:
        turn = ('<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
    reply = _read(reply_format, turn)
    assert reply.reasoning == "Call it." and reply.content == ""
    assert [(name, json.loads(arguments)) for _, name, arguments in reply.calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("text, reasoning, content", [
    ("<|channel|>analysis<|message|>Cut sh", "Cut sh", ""),  # cut by max_tokens: reasoning
    ('{"a": 1}', "", '{"a": 1}'),  # constrained to JSON: no header, content
    ("<|chan", "", "<|chan"),
    ("<|channel|>commentary to=functions.launch<|message|>{}<|call|>", "", "{}"),  # no such tool: its text
    ("<|channel|>commentary to=functions.get_weather<|message|>{not json<|call|>", "", "{not json"),
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done", "",
     "Checking.Done"),  # a preamble is content
])
def test_gpt_oss_no_text_is_lost(tokenizer, text, reasoning, content):
    reply = _read(_format(tokenizer, HARMONY, tools=[WEATHER]), text)
    assert (reply.reasoning, reply.content, reply.calls) == (reasoning, content, [])


def test_gpt_oss_required_call_grammar_and_stream(tokenizer):
    """A required call is constrained to harmony's call message; its name, then its arguments, stream."""
    reply_format = _format(tokenizer, HARMONY, tools=[WEATHER], tool_choice="required", constrained=True)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    grammar = reply_format.tools.grammar(compiler, tokenizer)
    reply = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar.text)
    assert matcher.consume_tokens(tokenizer(reply, add_special_tokens=False).input_ids), matcher.get_error()
    assert matcher.is_accepting()
    reader = reply_format.reader()
    deltas = [delta for char in reply for delta in reader.add(char)] + reader.finish()
    assert deltas[0][0] == "call" and deltas[0][3] == "get_weather"
    assert all(delta[0] == "arguments" for delta in deltas[1:]) and len(deltas) > 3
    assert "".join(delta[2] for delta in deltas[1:]) == '{"city":"Paris"}'
