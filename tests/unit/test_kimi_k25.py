"""Kimi K2.5's multimodal checkpoint, served as its text model (blocks/families.py MULTIMODAL_CHECKPOINTS):
read from the published layout (tests/helpers/kimi_k25.py) as transformers' own class for it reads it
(Kimi_K25ForConditionalGeneration, AutoModelForCausalLM does not take kimi_k25), its vision tower never read,
and images refused by the client with a clear error instead of being dropped."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, DeepseekV3Config, DeepseekV3ForCausalLM

from bloompeer import AutoDistributedModelForCausalLM, DistributedLlamaForCausalLM
from bloompeer.blocks import open_checkpoint
from bloompeer.blocks.llama import LLAMA
from bloompeer.errors import RequestError

IDS = torch.randint(4, 250, (2, 20), generator=torch.Generator().manual_seed(0))  # past YaRN's original 16


@pytest.fixture(scope="module")
def reference(kimi_k25_checkpoint):
    """transformers' model of the published checkpoint; its text model computes experts with grouped_mm."""
    model = AutoModelForImageTextToText.from_pretrained(kimi_k25_checkpoint, dtype=torch.float32).eval()
    assert model.model.language_model.config._experts_implementation == "grouped_mm"
    return model


def test_its_text_model_is_read_from_text_config_and_language_model(kimi_k25_checkpoint):
    checkpoint = open_checkpoint(kimi_k25_checkpoint)
    assert json.loads((kimi_k25_checkpoint / "config.json").read_text())["text_config"]["model_type"] == "kimi_k2"
    config = checkpoint.config()
    assert checkpoint.family is LLAMA and type(config) is DeepseekV3Config and config.model_type == "deepseek_v3"
    assert config.num_hidden_layers == 4 and not config.tie_word_embeddings and config.q_lora_rank == 24
    names = checkpoint.weight_map()
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= set(names)
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in names
    client = checkpoint.load_tensors(LLAMA.client_tensor_prefixes, torch.float32, desc=None)
    assert set(client) == {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}  # no vision tensor


@torch.no_grad()
def test_its_blocks_compute_what_transformers_text_model_does(kimi_k25_checkpoint, reference):
    """Our span of all 4 blocks against Kimi_K25ForConditionalGeneration's text model, bitwise; and that text
    model is DeepseekV3ForCausalLM on the same tensors (the class the tokens are compared with, in effect)."""
    text_model = reference.model.language_model
    span = open_checkpoint(kimi_k25_checkpoint).load_span(0, 4, torch.float32)
    hidden = span(text_model.embed_tokens(IDS), None)
    torch.testing.assert_close(text_model.norm(hidden), text_model(IDS).last_hidden_state, rtol=0, atol=0)
    deepseek = DeepseekV3ForCausalLM(reference.config.text_config).eval()
    deepseek.model.load_state_dict(text_model.state_dict())
    deepseek.lm_head.load_state_dict(reference.lm_head.state_dict())
    torch.testing.assert_close(deepseek(IDS).logits, reference(IDS).logits, rtol=0, atol=0)


@torch.no_grad()
def test_the_client_holds_its_embeddings_final_norm_and_head(kimi_k25_checkpoint, reference):
    checkpoint = open_checkpoint(kimi_k25_checkpoint)
    ours_class = AutoDistributedModelForCausalLM.class_for(str(kimi_k25_checkpoint))
    assert ours_class is DistributedLlamaForCausalLM
    ours = ours_class._with_local_tensors(checkpoint, checkpoint.config(), torch.float32, None, 0)
    text_model = reference.model.language_model
    assert torch.equal(ours.remote.embed(IDS), text_model.embed_tokens(IDS))
    hidden = torch.randn(2, 3, 64)
    assert torch.equal(ours.remote.final_norm(hidden), text_model.norm(hidden))
    assert torch.equal(ours.lm_head.weight, reference.lm_head.weight)
    assert not torch.equal(ours.lm_head.weight, ours.remote.embed_tokens.weight)


def test_its_head_is_tied_where_transformers_ties_it(kimi_k25_checkpoint, tmp_path):
    """transformers' multimodal class ties the head by the outer config's tie_word_embeddings (Kimi_K25Config's
    default: true), not by its text_config's (false here): a checkpoint whose config.json does not say, and that
    stores no head, has its head tied; so does ours."""
    path = tmp_path / "tied"
    shutil.copytree(kimi_k25_checkpoint, path)
    config_json = json.loads((path / "config.json").read_text())
    del config_json["tie_word_embeddings"]
    (path / "config.json").write_text(json.dumps(config_json))
    with safe_open(path / "model.safetensors", framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys() if name != "language_model.lm_head.weight"}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    theirs = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    assert theirs.lm_head.weight is theirs.model.language_model.embed_tokens.weight
    checkpoint = open_checkpoint(path)
    assert checkpoint.config().tie_word_embeddings and config_json["text_config"]["tie_word_embeddings"] is False
    ours = DistributedLlamaForCausalLM._with_local_tensors(checkpoint, checkpoint.config(), torch.float32, None, 0)
    assert torch.equal(ours.lm_head.weight, theirs.lm_head.weight)


@torch.no_grad()
def test_images_are_refused_with_a_clear_error_before_any_session(kimi_k25_checkpoint):
    """pixel_values would otherwise be dropped without a word (transformers' generate passes unknown keyword
    arguments on to forward). The model has no swarm connection: a session opened first would fail otherwise."""
    checkpoint = open_checkpoint(kimi_k25_checkpoint)
    ours = DistributedLlamaForCausalLM._with_local_tensors(checkpoint, checkpoint.config(), torch.float32, None, 0)
    pixels, grid = torch.zeros(4, 3, 14, 14), torch.tensor([[1, 2, 2]])
    with pytest.raises(RequestError, match="image_grid_thw, pixel_values: images, video and sound are not taken"):
        ours.generate(IDS[:1], pixel_values=pixels, image_grid_thw=grid, max_new_tokens=2)
    with pytest.raises(RequestError, match="pass the text alone"):
        ours(IDS[:1], pixel_values=pixels)
    with pytest.raises(RequestError, match="pixel_values_videos"):
        ours.remote(IDS[:1], pixel_values_videos=pixels)
