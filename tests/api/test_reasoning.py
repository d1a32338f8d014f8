"""Reasoning through the official openai client against `bloompeer api` over the shared swarm, for a
checkpoint whose chat template thinks: the tiny model's copy (same name, so the same servers) with a
template that opens a think block in its generation prompt (as Qwen3-Thinking's and DeepSeek-R1's
do) unless `enable_thinking` is false (then it writes the empty block, as Qwen3's). The greedy reply
is what transformers generates on the same weights; the API returns it as reasoning_content (a block
cut by max_tokens is reasoning), streamed apart from the content, or, with thinking off, as content.
The Responses API gives the same reasoning as a reasoning item."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoTokenizer

from .conftest import start_api

THINKING = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>"
            "{% if enable_thinking is defined and enable_thinking is false %}<think></think>"
            "{% else %}<think>{% endif %}{% endif %}")  # no newline: after one, the tiny model's
# greedy reply is only newlines
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def thinking_api(swarm, tiny_checkpoint, tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking") / tiny_checkpoint.name  # the same name: the same swarm
    shutil.copytree(tiny_checkpoint, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = THINKING
    tokenizer.save_pretrained(path)
    process = start_api(path, tmp_path_factory.mktemp("thinking-api-logs"), "--initial-peers", *swarm.initial_peers)
    yield process, tokenizer
    process.stop()


@pytest.fixture(scope="module")
def client(thinking_api):
    with thinking_api[0].client() as client:
        yield client


def _expected(reference_model, tokenizer, max_tokens: int, **template_kwargs) -> str:
    """transformers' greedy text after the template's prompt."""
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **template_kwargs)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        output = reference_model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                                          pad_token_id=tokenizer.pad_token_id)
    generated = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)
    assert "think>" not in generated and generated.strip()  # the random model writes text, never closes the block
    return generated


def test_a_thinking_reply_is_reasoning_content(client, model_id, thinking_api, reference_model):
    expected = _expected(reference_model, thinking_api[1], 12)
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0)
    message = response.choices[0].message
    assert message.reasoning_content == expected.lstrip() and message.content == ""
    assert response.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0,
                                                 stream=True))
    deltas = [choice.delta for chunk in chunks for choice in chunk.choices]
    assert "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas) == expected.lstrip()
    assert "".join(delta.content or "" for delta in deltas) == ""
    assert sum(bool(getattr(delta, "reasoning_content", None)) for delta in deltas) > 1  # streamed, not at the end


def test_with_thinking_off_the_reply_is_content(client, model_id, thinking_api, reference_model):
    expected = _expected(reference_model, thinking_api[1], 12, enable_thinking=False)
    response = client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = response.choices[0].message
    assert message.content == expected and getattr(message, "reasoning_content", None) is None




def test_responses_give_the_reasoning_as_a_reasoning_item(client, model_id, thinking_api, reference_model):
    expected = _expected(reference_model, thinking_api[1], 12).lstrip()
    response = client.responses.create(model=model_id, input=MESSAGES[0]["content"], max_output_tokens=12,
                                       temperature=0)
    reasoning, = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == expected
    assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 12
    events = list(client.responses.create(model=model_id, input=MESSAGES[0]["content"], max_output_tokens=12,
                                          temperature=0, stream=True))
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == expected
    assert not [event for event in events if event.type == "response.output_text.delta"]
