"""Several prompts and several choices per request, OpenAI's presence/frequency penalties and
logit_bias, through the official openai client, plain and streamed: each choice equals what
transformers' own model gives for it (the penalties and bias applied by a loop written here from
OpenAI's definition)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

PROMPTS = ["The swarm", "Several prompts in one request", "A third"]


@pytest.fixture(scope="module")
def reference(reference_model, tokenizer):
    """reference(text, n, presence, frequency, bias) -> text of greedy decoding with OpenAI's rules:
    logit[j] -= count[j] * frequency + (count[j] > 0) * presence; logit[j] += bias[j]."""

    def greedy(text, max_new_tokens, presence=0.0, frequency=0.0, bias=None):
        return tokenizer.decode(greedy_ids(text, max_new_tokens, presence, frequency, bias), skip_special_tokens=True)

    @torch.inference_mode()
    def greedy_ids(text, max_new_tokens, presence=0.0, frequency=0.0, bias=None):
        ids = tokenizer(text).input_ids
        new: list[int] = []
        for _ in range(max_new_tokens):
            logits = reference_model(torch.tensor([ids + new])).logits[0, -1].float()
            for token, count in Counter(new).items():
                logits[token] -= count * frequency + presence
            for token, value in (bias or {}).items():
                logits[token] += value
            new.append(int(logits.argmax()))
            if new[-1] == tokenizer.eos_token_id:
                break
        return new

    greedy.ids = greedy_ids
    return greedy


def _streamed_texts(chunks, count: int) -> list[str]:
    texts = [""] * count
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text if hasattr(choice, "text") else choice.delta.content or ""
    return texts


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_each_equal_transformers(client, model_id, reference, tokenizer, stream):
    expected = [reference(prompt, 10) for prompt in PROMPTS]
    prompts = [tokenizer(prompt).input_ids for prompt in PROMPTS] if stream else PROMPTS  # token ids, or texts
    response = client.completions.create(model=model_id, prompt=prompts, max_tokens=10, temperature=0, stream=stream,
                                         stream_options={"include_usage": True} if stream else None)
    if stream:
        chunks = list(response)
        assert _streamed_texts(chunks, len(PROMPTS)) == expected
        usage = chunks[-1].usage
    else:
        assert [choice.index for choice in response.choices] == list(range(len(PROMPTS)))
        assert [choice.text for choice in response.choices] == expected
        usage = response.usage
    assert usage.prompt_tokens == sum(len(tokenizer(prompt).input_ids) for prompt in PROMPTS)
    assert usage.completion_tokens == sum(len(reference.ids(prompt, 10)) for prompt in PROMPTS)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_per_prompt_draw_apart_and_repeat_with_a_seed(client, model_id, stream):
    def sample(n, seed, prompt=PROMPTS):
        response = client.completions.create(model=model_id, prompt=prompt, max_tokens=12, temperature=1.0, n=n,
                                             seed=seed, stream=stream)
        if stream:
            return _streamed_texts(list(response), n * (len(prompt) if isinstance(prompt, list) else 1))
        assert [choice.index for choice in response.choices] == list(range(len(response.choices)))
        return [choice.text for choice in response.choices]

    texts = sample(3, 5)
    assert len(texts) == 3 * len(PROMPTS)
    assert texts == sample(3, 5)  # seeded: the same again, however the choices interleave
    assert len(set(texts[:3])) > 1  # each choice draws its own tokens
    assert sample(1, 5, PROMPTS[1]) == [texts[3]]  # a prompt's first choice is what n=1 gives


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n_choices(client, model_id, stream):
    response = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=6, temperature=0, n=2, stream=stream)
    if stream:
        chunks = list(response)
        assert {chunk.choices[0].index for chunk in chunks if chunk.choices[0].delta.role} == {0, 1}
        texts = _streamed_texts(chunks, 2)
    else:
        texts = [choice.message.content for choice in response.choices]
    assert texts[0] == texts[1]  # greedy: both choices the same


@pytest.mark.parametrize("presence, frequency, stream", [(1.5, 0.0, False), (0.0, 2.0, True), (-1.0, 0.5, False)])
def test_presence_and_frequency_penalties_as_openai_defines_them(client, model_id, reference, presence, frequency,
                                                                 stream):
    expected = reference(PROMPTS[0], 10, presence, frequency)
    response = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                         presence_penalty=presence, frequency_penalty=frequency, stream=stream)
    text = "".join(chunk.choices[0].text for chunk in response) if stream else response.choices[0].text
    assert text == expected
    assert expected != reference(PROMPTS[0], 10)  # the penalties changed what greedy picks


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_adds_to_the_logits(client, model_id, reference, tokenizer, stream):
    favoured = tokenizer("z").input_ids[0]
    banned = tokenizer(reference(PROMPTS[1], 1)).input_ids[0]  # greedy's first token
    bias = {favoured: 3.0, banned: -100.0}
    expected = reference(PROMPTS[1], 8, bias=bias)
    assert expected != reference(PROMPTS[1], 8)
    response = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0,
        logit_bias={str(favoured): 100}, stream=stream)
    if stream:
        content = "".join(c.choices[0].delta.content or "" for c in response)
    else:
        content = response.choices[0].message.content
    assert content == "zzz"
    response = client.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                         logit_bias={str(token): value for token, value in bias.items()}, stream=stream)
    text = "".join(chunk.choices[0].text for chunk in response) if stream else response.choices[0].text
    assert text == expected
