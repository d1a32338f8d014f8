"""Tool calls per family (bloompeer/peer/api/tool_formats.py, tools.py), with no model: a call that the
family's chat template writes into an assistant turn is parsed back as that call; the grammar of a
required call accepts what the family writes and then only the end; a reply read as it streams gives
each call's name first, then its arguments, adding up to the reply read whole; and text that only
looks like a call stays text.

The templates are the tool parts of the families' own (Qwen2.5 and Qwen3, Llama 3.1, Mistral v3),
abridged to what renders tools, calls and results (tests never download a checkpoint). transformers
renders with trim_blocks, so a newline right after a block tag is an expression, as in the originals.
Mistral lists the tools before the last user turn, so its assistant turn is what follows the last
[/INST]."""

from __future__ import annotations

import json
from types import SimpleNamespace

import llguidance
import pytest
from transformers import AutoTokenizer

from bloompeer.peer.api.constrained import GrammarCompiler
from bloompeer.peer.api.openai_schema import ChatCompletionRequest
from bloompeer.peer.api.tool_formats import CALL_FORMATS, call_format_for_template
from bloompeer.peer.api.tools import ChatTools, ToolCallReader
from bloompeer.peer.cli.default_model import write_byte_tokenizer

QWEN = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou are provided with function signatures within <tools></tools> "
    "XML tags:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant{% if message.content %}\n{{ message.content }}"
    "{% endif %}{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    "{{ '\\n<tool_call>\\n' }}"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' and tools and loop.first %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    'best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.Do not use variables.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n"
    "{% endfor %}{{ message.content }}<|eot_id|>"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- set tool_call = message.tool_calls[0].function %}"
    '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "{{ tool_call.name }}", "parameters": '
    "{{ tool_call.arguments | tojson }}}<|eot_id|>"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    "{# <|python_tag|> opens built-in tool calls #}")
MISTRAL = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{%- endif %}[INST] {{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{%- for tool_call in message.tool_calls %}{%- set f = tool_call.function %}"
    '{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}, "id": "{{ tool_call.id }}"}'
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]</s>"
    "{%- elif message.role == 'assistant' %}{{ message.content }}</s>"
    '{%- elif message.role == \'tool\' %}[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": '
    '"{{ message.tool_call_id }}"}[/TOOL_RESULTS]{%- endif %}{%- endfor %}')
MISTRAL_ARGS = (  # Mistral Small 3.2's, Magistral's, Devstral's: a call is [TOOL_CALLS]NAME[ARGS]{...}
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{%- endif %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' and message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "[TOOL_CALLS]{{ tool_call.function.name }}[ARGS]{{ tool_call.function.arguments | tojson }}{%- endfor %}</s>"
    "{%- elif message.role == 'assistant' %}{{ message.content }}</s>"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]{%- endif %}{%- endfor %}")
TEMPLATES = {"qwen": (QWEN, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>"), "mistral": (MISTRAL, "</s>"),
             "mistral_args": (MISTRAL_ARGS, "</s>")}

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"]}}}
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "utc"})]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bytes")
    write_byte_tokenizer(directory)
    return AutoTokenizer.from_pretrained(directory)


def _tools(tokenizer, template: str | None, tool_choice="auto", parallel: bool = True) -> ChatTools:
    tokenizer.chat_template = template
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER, TIME],
                                 tool_choice=tool_choice, parallel_tool_calls=parallel)
    return ChatTools.of(body, tokenizer)


def _assistant_turn(tokenizer, family: str, calls) -> str:
    """What the family's template writes for an assistant turn that made `calls`."""
    template, end = TEMPLATES[family]
    user = {"role": "user", "content": "Weather in Paris?"}
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)]}
    tools = [WEATHER, TIME]
    before = tokenizer.apply_chat_template([user], tools=tools, chat_template=template, tokenize=False,
                                           add_generation_prompt=True)
    after = tokenizer.apply_chat_template([user, assistant], tools=tools, chat_template=template, tokenize=False)
    turn = after[len(before):] if after.startswith(before) else after[after.rindex("[/INST]") + len("[/INST]"):]
    return turn[:turn.index(end)]


@pytest.mark.parametrize("family", ["qwen", "llama3", "mistral", "mistral_args"])
def test_a_call_the_template_writes_is_parsed_back(tokenizer, family):
    assert call_format_for_template(TEMPLATES[family][0]).name == family
    calls = CALLS if CALL_FORMATS[family].parallel else CALLS[:1]
    reply = _assistant_turn(tokenizer, family, calls)
    assert CALL_FORMATS[family].parse(reply, {"get_weather", "get_time"})[1] == calls
    assert CALL_FORMATS[family].parse("Sure: " + reply, {"get_weather", "get_time"}) == (
        ("Sure:", calls) if family == "qwen" else None)  # only Qwen writes text before its calls


@pytest.mark.parametrize("reply", [
    '{"name": "get_weather", "arguments": {"city": "Paris"',  # cut short
    '{"name": "launch_rockets", "arguments": {}}',  # no such tool
    '{"name": "get_weather", "arguments": "Paris"}',  # arguments not an object
    '{"name": "get_weather", "arguments": {}} and more',  # text after it
    '{"answer": 42}',
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"name": "get_time", "arguments": {}}',  # unclosed
    '[TOOL_CALLS] [{"name": "get_time"}]',
])
@pytest.mark.parametrize("family", ["json", "qwen", "llama3", "mistral", "mistral_args"])
def test_text_that_only_looks_like_a_call_stays_text(tokenizer, family, reply):
    template = TEMPLATES[family][0] if family in TEMPLATES else None
    tools = _tools(tokenizer, template)
    reader = ToolCallReader(tools)
    deltas = [delta for char in reply for delta in reader.add(char)] + reader.finish()
    assert not reader.calls and "".join(delta[1] for delta in deltas) == reply


@pytest.mark.parametrize("family", ["json", "qwen", "llama3", "mistral"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_call_streams_name_first_then_arguments(tokenizer, family, tool_choice):
    """The grammar accepts the family's compact call and then only the end; read a character at a time,
    the reply gives the call's id and name before any argument, and its arguments add up."""
    template = TEMPLATES[family][0] if family in TEMPLATES else None
    tools = _tools(tokenizer, template, tool_choice)
    call_format = tools.call_format
    body = json.dumps({"name": "get_weather", call_format.arguments_key: {"city": "Paris", "days": 2}},
                      separators=(",", ":"))
    reply = "".join(call_format.before) + call_format.call_prefix + body + call_format.call_suffix + call_format.after
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    grammar = tools.grammar(compiler, tokenizer)
    matcher = llguidance.LLMatcher(compiler.tokenizer, grammar.text)
    assert matcher.consume_tokens(tokenizer(reply, add_special_tokens=False).input_ids), matcher.get_error()
    assert matcher.is_accepting()
    reader = ToolCallReader(tools)
    deltas = [delta for char in reply for delta in reader.add(char)] + reader.finish()
    assert deltas[0][0] == "call" and deltas[0][3] == "get_weather"
    assert all(delta[0] == "arguments" for delta in deltas[1:]) and len(deltas) > 3
    assert json.loads("".join(delta[2] for delta in deltas[1:])) == {"city": "Paris", "days": 2}


def test_parallel_calls_in_qwens_format(tokenizer):
    tools = _tools(tokenizer, QWEN, "required")
    reply = "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, separators=(",", ":"))}\n</tool_call>'
                      for n, a in CALLS)
    reader = ToolCallReader(tools)
    deltas = [delta for char in reply for delta in reader.add(char)] + reader.finish()
    assert [(d[1], d[3]) for d in deltas if d[0] == "call"] == [(0, "get_weather"), (1, "get_time")]
    for index, (_, arguments) in enumerate(CALLS):
        assert json.loads("".join(d[2] for d in deltas if d[0] == "arguments" and d[1] == index)) == arguments
    compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    for parallel, accepted in ((True, True), (False, False)):
        grammar = _tools(tokenizer, QWEN, "required", parallel).grammar(compiler, tokenizer)
        matcher = llguidance.LLMatcher(compiler.tokenizer, grammar.text)
        assert matcher.consume_tokens(tokenizer(reply, add_special_tokens=False).input_ids) is accepted


def test_auto_streams_text_and_holds_what_may_be_a_call(tokenizer):
    tools = _tools(tokenizer, QWEN)
    reader = ToolCallReader(tools)
    assert reader.add("Let me check. <tool") == [("content", "Let me check. ")]
    assert reader.add('_call>\n{"name":"get_time","arguments":{"zone":"utc"}}\n</tool_call>') == []
    finished = reader.finish()
    assert [d[0] for d in finished] == ["call", "arguments"] and finished[1][2] == '{"zone":"utc"}'
    tools = _tools(tokenizer, None)  # the JSON format: a reply that starts as text is text
    reader = ToolCallReader(tools)
    assert reader.add("Hello {") == [("content", "Hello {")]
    assert reader.add('"name": "get_time"}') == [("content", '"name": "get_time"}')]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_mistrals_newer_form_with_and_without_its_markers(tokenizer, tool_choice):
    """[TOOL_CALLS]NAME[ARGS]{...}; where the markers are special tokens the decoded text is NAME{...}.
    The grammar of a required call accepts the form, two calls in parallel too."""
    tools = _tools(tokenizer, MISTRAL_ARGS, tool_choice)
    assert tools.call_format.name == "mistral_args"
    with_markers = '[TOOL_CALLS]get_weather[ARGS]{"city":"Paris","days":2}[TOOL_CALLS]get_time[ARGS]{"zone":"utc"}'
    for reply in (with_markers, with_markers.replace("[TOOL_CALLS]", "").replace("[ARGS]", "")):
        reader = ToolCallReader(tools)
        deltas = [delta for char in reply for delta in reader.add(char)] + reader.finish()
        assert [d[3] for d in deltas if d[0] == "call"] == ["get_weather", "get_time"]
        for index, (_, arguments) in enumerate(CALLS):
            pieces = [d[2] for d in deltas if d[0] == "arguments" and d[1] == index]
            assert json.loads("".join(pieces)) == arguments
            if tool_choice == "required":  # as it is written: name first, then its arguments piece by piece
                assert len(pieces) > 3 and deltas.index(next(d for d in deltas if d[0] == "call" and d[1] == index)) < (
                    deltas.index(next(d for d in deltas if d[0] == "arguments" and d[1] == index)))
    if tool_choice == "required":
        compiler = GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
        matcher = llguidance.LLMatcher(compiler.tokenizer, tools.grammar(compiler, tokenizer).text)
        assert matcher.consume_tokens(tokenizer(with_markers, add_special_tokens=False).input_ids), matcher.get_error()
        assert matcher.is_accepting()
