"""Constrained decoding's processor (bloompeer/peer/api/constrained.py) on the demo model and its draft,
in transformers' own generate: replies follow the schema, the mask is llguidance's, and speculative
decoding (the draft proposes, the target verifies candidate prefixes, a rejected tail is dropped) gives
plain greedy's constrained reply, since the processor follows the sequence it is given."""

import json

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer, BloomForCausalLM, LogitsProcessorList

from bloompeer.peer.api.constrained import GrammarCompiler, UnsupportedGrammar
from bloompeer.peer.cli.default_model import DEMO_DRAFT_MODEL_DIR, DEMO_MODEL_DIR

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 24}, "year": {"type": "integer", "minimum": 1700,
                                                                          "maximum": 1900},
                   "characters": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2}},
    "required": ["title", "year", "characters"],
    "additionalProperties": False,
}
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id})


@pytest.fixture(scope="module")
def target():
    return BloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft():
    return BloomForCausalLM.from_pretrained(DEMO_DRAFT_MODEL_DIR, dtype=torch.float32).eval()


def _reply(model, tokenizer, compiler, prompt: list[int], **kwargs) -> str:
    processor = compiler.json_schema(SCHEMA).processor(len(prompt))
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                logits_processor=LogitsProcessorList([processor]),
                                pad_token_id=tokenizer.pad_token_id, **kwargs)
    return tokenizer.decode(output[0, len(prompt):], skip_special_tokens=True)


def test_speculative_decoding_gives_plain_greedys_constrained_reply(target, draft, tokenizer, compiler):
    prompt = tokenizer("It is a truth universally acknowledged, that a single man in possession").input_ids
    plain = _reply(target, tokenizer, compiler, prompt)
    jsonschema.validate(json.loads(plain), SCHEMA)
    passes = []
    hook = target.register_forward_pre_hook(lambda module, args: passes.append(1))
    try:
        assert _reply(target, tokenizer, compiler, prompt, assistant_model=draft) == plain
    finally:
        hook.remove()
    assert len(passes) < len(tokenizer(plain).input_ids), "the draft's proposals were taken several at a time"


def test_the_processor_follows_rollbacks(tokenizer, compiler):
    """Asked after a sequence, then after a shorter or different one, it masks as if only that one came."""
    text = '{"title":"Emma","year":1815,"characters":[]}'
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prompt = [5, 6, 7]
    processor = compiler.json_schema(SCHEMA).processor(len(prompt))
    scores = torch.zeros(1, len(tokenizer))

    def allowed_after(tokens: list[int]) -> torch.Tensor:
        return torch.isfinite(processor(torch.tensor([prompt + tokens]), scores.clone()))[0]

    fresh = [allowed_after(ids[:length]) for length in range(len(ids) + 1)]
    assert fresh[-1].nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # complete: only the end
    for length in (3, 0, len(ids), 5):  # back, forward, back: each as if decoded straight
        assert torch.equal(allowed_after(ids[:length]), fresh[length])
    refused = int((~fresh[2]).nonzero()[0])
    assert torch.equal(allowed_after(ids[:2] + [refused]), fresh[2])  # a refused candidate is not taken


def test_json_object_and_refusals(compiler):
    assert compiler.json_object().processor(0) is not None
    with pytest.raises(UnsupportedGrammar, match="Invalid type: widget"):
        compiler.json_schema({"type": "widget"})
    with pytest.raises(UnsupportedGrammar, match="Unimplemented keys"):
        compiler.json_schema({"type": "object", "if": {}, "then": {}}, strict=True)
    compiler.json_schema({"type": "object", "if": {}, "then": {}}, strict=False)  # ignored without strict
