"""The official openai client against `bloompeer api` on a real swarm: completions and chat, plain
and streamed, equal to transformers' own greedy continuation on the same weights."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

PROMPT = "The swarm computes"


@pytest.fixture(scope="module")
def reference(reference_model, tokenizer):
    """reference(text, n) -> (token ids of HF's greedy continuation, its text, its finish_reason)."""

    @torch.inference_mode()
    def continuation(text: str, max_new_tokens: int):
        ids = tokenizer(text, return_tensors="pt").input_ids
        out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=tokenizer.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        ended = len(new) < max_new_tokens or new[-1] == tokenizer.eos_token_id
        return new, tokenizer.decode(new, skip_special_tokens=True), "stop" if ended else "length"

    return continuation


def test_models_lists_the_checkpoint_with_its_coverage(client, model_id):
    models = client.models.list().data
    assert [model.id for model in models] == [model_id]
    assert models[0].model_extra["all_blocks_covered"] is True
    assert models[0].model_extra["missing_blocks"] == []
    assert models[0].model_extra["weights"] == ["float32"]  # how its online servers store the weights


def test_health_is_200_while_every_block_is_served(api, model_id):
    status, content_type, body = api.get("/health")
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body) == {"status": "ok", "model": model_id, "missing_blocks": []}


def test_greedy_completion_equals_transformers(client, model_id, reference, tokenizer):
    new_ids, text, finish_reason = reference(PROMPT, 24)
    response = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0)
    assert response.choices[0].text == text
    assert response.choices[0].finish_reason == finish_reason
    assert response.usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    assert response.usage.completion_tokens == len(new_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(new_ids)


def test_token_id_prompts_work_as_text_prompts(client, model_id, reference, tokenizer):
    _, text, _ = reference(PROMPT, 8)
    response = client.completions.create(model=model_id, prompt=tokenizer(PROMPT).input_ids, max_tokens=8,
                                         temperature=0)
    assert response.choices[0].text == text


def test_streamed_text_equals_the_plain_response(client, model_id, reference):
    new_ids, text, finish_reason = reference(PROMPT, 24)
    chunks = list(client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    pieces = [chunk.choices[0].text for chunk in chunks if chunk.choices and chunk.choices[0].text]
    assert "".join(pieces) == text
    assert 1 < len(pieces) <= len(new_ids)  # one event per token as it arrives (a half character waits)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == finish_reason
    assert chunks[-1].usage.completion_tokens == len(new_ids)


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
CHAT_AS_TEXT = "System: Be brief.\nUser: Hello there\nAssistant:"  # the documented plain template


def test_chat_plain_and_streamed_equal_transformers(client, model_id, reference):
    new_ids, text, finish_reason = reference(CHAT_AS_TEXT, 20)
    response = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=20, temperature=0)
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == text
    assert response.choices[0].finish_reason == finish_reason
    assert response.usage.completion_tokens == len(new_ids)

    chunks = list(client.chat.completions.create(model=model_id, messages=CHAT, max_completion_tokens=20,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish_reason


def test_a_stop_sequence_ends_the_text_before_it(client, model_id, reference):
    _, text, _ = reference(PROMPT, 24)
    start = next(i for i in range(4, len(text) - 2) if "\ufffd" not in text[i:i + 2])
    stop = text[start:start + 2]
    expected = text[:text.find(stop)]
    response = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected, "stop")
    streamed = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


def test_seeded_sampling_repeats_itself(client, model_id):
    def sample(seed):
        return client.completions.create(model=model_id, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.9,
                                         seed=seed).choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1  # sampling, not greedy in disguise


def test_concurrent_requests_each_equal_transformers(client, model_id, reference):
    prompts = [f"{PROMPT} {i}" for i in range(6)]
    expected = [reference(prompt, 12)[1] for prompt in prompts]

    def complete(prompt):
        return client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=0).choices[0].text

    def chat(prompt):
        return client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=12, temperature=0).choices[0].message.content

    with ThreadPoolExecutor(len(prompts) + 2) as pool:
        texts = list(pool.map(complete, prompts))
        chats = list(pool.map(chat, prompts[:2]))
    assert texts == expected
    assert chats == [reference(f"User: {prompt}\nAssistant:", 12)[1] for prompt in prompts[:2]]
