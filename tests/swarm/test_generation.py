"""Tokens and logits through a two-server swarm equal transformers' BloomForCausalLM on one machine."""

import pytest
import torch

PROMPT = torch.tensor([[1, 60, 61, 62, 63, 64]])
PADDED = torch.tensor([[0, 0, 0, 70, 71, 72], [80, 81, 82, 83, 84, 85]])
PADDED_MASK = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])


@torch.inference_mode()
def test_greedy_generate_equals_hf(model, reference_model):
    ours = model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    theirs = reference_model.generate(PROMPT, max_new_tokens=24, do_sample=False)
    assert ours.tolist() == theirs.tolist()


@torch.inference_mode()
def test_sampling_with_the_same_seed_equals_hf(model, reference_model):
    kwargs = dict(max_new_tokens=16, do_sample=True, temperature=0.9, top_k=20, top_p=0.95)
    torch.manual_seed(7)
    ours = model.generate(PROMPT, **kwargs)
    torch.manual_seed(7)
    theirs = reference_model.generate(PROMPT, **kwargs)
    assert ours.tolist() == theirs.tolist()


@torch.inference_mode()
def test_full_forward_logits_match_hf(model, reference_model):
    ids = torch.randint(4, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(ids).logits, reference_model(ids).logits, rtol=0, atol=1e-4)


@torch.inference_mode()
def test_padded_batch_of_two_prompts(model, reference_model):
    ours = model(PADDED, attention_mask=PADDED_MASK).logits
    theirs = reference_model(PADDED, attention_mask=PADDED_MASK).logits
    real = PADDED_MASK.bool()  # padded positions hold no meaningful output in either
    torch.testing.assert_close(ours[real], theirs[real], rtol=0, atol=1e-4)
    kwargs = dict(attention_mask=PADDED_MASK, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert model.generate(PADDED, **kwargs).tolist() == reference_model.generate(PADDED, **kwargs).tolist()


@torch.inference_mode()
def test_beam_search_reorders_server_caches(model, reference_model):
    kwargs = dict(attention_mask=PADDED_MASK, max_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0)
    assert model.generate(PADDED, **kwargs).tolist() == reference_model.generate(PADDED, **kwargs).tolist()


@torch.inference_mode()
def test_inference_session_spans_several_generate_calls(model, reference_model):
    expected = reference_model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    with model.inference_session(max_length=32) as session:
        first = model.generate(PROMPT, max_new_tokens=5, do_sample=False)
        assert session.position == first.shape[1] - 1  # the last token is not processed yet
        second = model.generate(first, max_new_tokens=7, do_sample=False)
    assert second.tolist() == expected.tolist()


@torch.inference_mode()
def test_forward_calls_inside_a_session_run_only_the_new_tokens(model, reference_model):
    full = torch.cat([PROMPT, torch.tensor([[90, 91]])], dim=1)
    expected = reference_model(full).logits
    with model.inference_session(max_length=16) as session:
        first = model(PROMPT).logits
        second = model(full[:, PROMPT.shape[1]:]).logits
        assert session.position == full.shape[1]
    torch.testing.assert_close(torch.cat([first, second], 1), expected, rtol=0, atol=1e-4)


def test_a_session_refuses_more_than_its_max_length(model):
    with model.inference_session(max_length=4):
        with pytest.raises(ValueError, match="max_length"):
            model(PROMPT)


@torch.inference_mode()
def test_concurrent_sessions_give_the_results_they_give_alone(model, reference_model):
    """Four sessions stepping at the same time (the servers batch them) match HF token by token."""
    import asyncio

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 200, (1, length), generator=generator) for length in (3, 5, 8, 13)]
    continuations = [torch.randint(4, 200, (1, 4), generator=generator) for _ in prompts]
    def embed(ids):
        return model.transformer.word_embeddings_layernorm(model.transformer.word_embeddings(ids))

    prompt_hidden = [embed(p) for p in prompts]
    continuation_hidden = [embed(c) for c in continuations]
    sessions = [model.client.open_session(max_length=32) for _ in prompts]

    async def run_all():
        outputs = await asyncio.gather(*(s.step(h) for s, h in zip(sessions, prompt_hidden)))
        outputs = [[o] for o in outputs]
        for t in range(4):
            steps = await asyncio.gather(*(s.step(h[:, t:t + 1]) for s, h in zip(sessions, continuation_hidden)))
            for collected, step in zip(outputs, steps):
                collected.append(step)
        for session in sessions:
            await session.close()
        return [torch.cat(o, dim=1) for o in outputs]

    for hidden, prompt, continuation in zip(model.client.runtime.run(run_all()), prompts, continuations):
        logits = model.lm_head(model.transformer.ln_f(hidden))
        expected = reference_model(torch.cat([prompt, continuation], dim=1)).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)
