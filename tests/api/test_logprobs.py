"""Logprobs, echo and prompt scoring through the official openai client: every logprob equals
torch.log_softmax of transformers' own logits on the same weights (float32) within 1e-4, prompts
are scored in one pass per request, and streamed choices add up to the plain ones."""

from __future__ import annotations

import openai
import pytest
import torch

from .conftest import sample_value, scrape

TOLERANCE = 1e-4
PROMPTS = ["The swarm", "Scoring prompts through several servers", "né"]  # "é": two byte tokens


@pytest.fixture(scope="module")
def hf_logprobs(reference_model):
    """hf_logprobs(ids) -> [len(ids), vocab]: log_softmax of transformers' logits after each prefix."""

    @torch.inference_mode()
    def logprobs(ids):
        logits = reference_model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def hf_greedy(reference_model, tokenizer):
    """hf_greedy(ids, n) -> (new token ids, log_softmax of the raw logits of each step [n, vocab])."""

    @torch.inference_mode()
    def greedy(ids, max_new_tokens):
        ids = torch.tensor([ids])
        out = reference_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=tokenizer.pad_token_id, output_logits=True,
                                       return_dict_in_generate=True)
        steps = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
        return out.sequences[0, ids.shape[1]:].tolist(), steps

    return greedy


def _assert_offsets_index_the_text(logprobs, text):
    assert "".join(logprobs.tokens) == text
    for token, offset in zip(logprobs.tokens, logprobs.text_offset):
        assert text[offset:offset + len(token)] == token


def _assert_top_equals(top: dict, expected_row: torch.Tensor, k: int):
    expected = torch.topk(expected_row, k).values.tolist()
    got = sorted(top.values(), reverse=True)
    # alternatives that read alike (half characters) keep only their best: the best k are there
    assert got[0] == pytest.approx(expected[0], abs=TOLERANCE)
    assert all(any(abs(value - wanted) < TOLERANCE for wanted in expected) for value in got)


def test_echo_scores_every_prompt_in_one_pass(client, api, model_id, tokenizer, hf_logprobs):
    before = scrape(api)
    response = client.completions.create(model=model_id, prompt=PROMPTS, echo=True, logprobs=3, max_tokens=0)
    after = scrape(api)
    assert sample_value(after, "bloompeer_api_scoring_passes_total", model=model_id) - \
        sample_value(before, "bloompeer_api_scoring_passes_total", model=model_id) == 1
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, response.choices):
        ids = tokenizer(prompt).input_ids
        expected = hf_logprobs(ids)
        assert choice.text == prompt and choice.finish_reason == "length"
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(ids)
        assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
        wanted = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
        assert logprobs.token_logprobs[1:] == pytest.approx(wanted, abs=TOLERANCE)
        for position in range(1, len(ids)):
            _assert_top_equals(logprobs.top_logprobs[position], expected[position - 1], 3)
        _assert_offsets_index_the_text(logprobs, choice.text)
    assert response.usage.prompt_tokens == sum(len(tokenizer(prompt).input_ids) for prompt in PROMPTS)
    assert response.usage.completion_tokens == 0

    as_ids = client.completions.create(model=model_id, prompt=[tokenizer(prompt).input_ids for prompt in PROMPTS],
                                       echo=True, logprobs=3, max_tokens=0)
    assert [choice.logprobs.token_logprobs for choice in as_ids.choices] == \
        [choice.logprobs.token_logprobs for choice in response.choices]


def test_lm_eval_scoring_request_picks_its_token_from_the_same_pass(client, api, model_id, tokenizer, hf_logprobs):
    """What lm-eval's local-completions sends for a loglikelihood: echo, logprobs 1, max_tokens 1."""
    ids = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    before = scrape(api)
    response = client.completions.create(model=model_id, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                         temperature=0, seed=1234)
    after = scrape(api)
    assert sample_value(after, "bloompeer_api_scoring_passes_total", model=model_id) - \
        sample_value(before, "bloompeer_api_scoring_passes_total", model=model_id) == 1
    for prompt_ids, choice in zip(ids, response.choices):
        last = hf_logprobs(prompt_ids)[-1]
        greedy = int(last.argmax())
        assert len(choice.logprobs.token_logprobs) == len(prompt_ids) + 1
        assert choice.logprobs.token_logprobs[-1] == pytest.approx(float(last[greedy]), abs=TOLERANCE)
        assert max(choice.logprobs.top_logprobs[-1].values()) == choice.logprobs.token_logprobs[-1]
        assert choice.text == tokenizer.decode(prompt_ids + [greedy], skip_special_tokens=True)
    assert response.usage.completion_tokens == len(PROMPTS)

    streamed = list(client.completions.create(model=model_id, prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                              temperature=0, stream=True))
    for index, choice in enumerate(response.choices):
        pieces = [chunk.choices[0] for chunk in streamed if chunk.choices and chunk.choices[0].index == index]
        assert "".join(piece.text for piece in pieces) == choice.text
        assert [value for piece in pieces if piece.logprobs for value in piece.logprobs.token_logprobs] == \
            choice.logprobs.token_logprobs


@pytest.mark.parametrize("stream", [False, True])
def test_generated_logprobs_equal_transformers(client, model_id, tokenizer, hf_greedy, hf_logprobs, stream):
    prompt = PROMPTS[1]
    ids = tokenizer(prompt).input_ids
    new_ids, steps = hf_greedy(ids, 10)
    response = client.completions.create(model=model_id, prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                         echo=True, stream=stream)
    if stream:
        chunks = list(response)
        text = "".join(chunk.choices[0].text for chunk in chunks)
        tokens = [token for chunk in chunks if chunk.choices[0].logprobs for token in chunk.choices[0].logprobs.tokens]
        token_logprobs = [value for chunk in chunks if chunk.choices[0].logprobs
                          for value in chunk.choices[0].logprobs.token_logprobs]
        offsets = [value for chunk in chunks if chunk.choices[0].logprobs
                   for value in chunk.choices[0].logprobs.text_offset]
    else:
        choice = response.choices[0]
        text, tokens, token_logprobs = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        offsets = choice.logprobs.text_offset
        _assert_offsets_index_the_text(choice.logprobs, text)
        for position, step in enumerate(steps):
            _assert_top_equals(choice.logprobs.top_logprobs[len(ids) + position], step, 2)
    assert text == prompt + tokenizer.decode(new_ids, skip_special_tokens=True)
    assert "".join(tokens) == text and offsets[0] == 0 and offsets[len(ids)] == len(prompt)
    prompt_scores = hf_logprobs(ids)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    generated_scores = steps[torch.arange(len(new_ids)), torch.tensor(new_ids)].tolist()
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(prompt_scores + generated_scores, abs=TOLERANCE)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_transformers(client, model_id, tokenizer, hf_greedy, stream):
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tokenizer("User: Hello there\nAssistant:").input_ids
    new_ids, steps = hf_greedy(ids, 8)
    response = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0,
                                              logprobs=True, top_logprobs=4, stream=stream)
    if stream:
        chunks = list(response)
        content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
        entries = [entry for chunk in chunks if chunk.choices[0].logprobs
                   for entry in chunk.choices[0].logprobs.content]
    else:
        content, entries = response.choices[0].message.content, response.choices[0].logprobs.content
    assert content == tokenizer.decode(new_ids, skip_special_tokens=True)
    assert len(entries) == len(new_ids)
    assert "".join(entry.token for entry in entries) == content
    for entry, token, step in zip(entries, new_ids, steps):
        assert entry.logprob == pytest.approx(float(step[token]), abs=TOLERANCE)
        assert entry.bytes == list(entry.token.encode())
        assert 1 <= len(entry.top_logprobs) <= 4
        assert entry.top_logprobs[0].logprob == pytest.approx(float(step.max()), abs=TOLERANCE)


@pytest.mark.parametrize("parameters, param", [
    ({"logprobs": 6}, "logprobs"),
    ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["ok", ""]}, "prompt"),
    ({"prompt": [[1, 2], [3, 999999]]}, "prompt"),
])
def test_invalid_new_parameters_are_400_naming_them(client, model_id, parameters, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**{"model": model_id, "prompt": "x", "max_tokens": 2, **parameters})
    error = raised.value.body if "message" in raised.value.body else raised.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_chat_top_logprobs_need_logprobs_and_stay_within_20(client, model_id):
    messages = [{"role": "user", "content": "x"}]
    for parameters in ({"top_logprobs": 3}, {"logprobs": True, "top_logprobs": 21}):
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=model_id, messages=messages, max_tokens=2, **parameters)
        assert "top_logprobs" in str(raised.value)
