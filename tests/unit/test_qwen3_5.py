"""Qwen3.5's and Qwen3.5-MoE's multimodal checkpoints, served as their text models (blocks/families.py
MULTIMODAL_CHECKPOINTS, blocks/qwen3_next.py's `qwen3_5_text` and `qwen3_5_moe_text` variants): read from the
published layout (tests/helpers/qwen3_5.py) as transformers reads it, the vision tower never read, each variant's
blocks as its differences from Qwen3-Next say, the client holding the text model's embeddings, final norm and head,
and images refused with a clear error. Their blocks' exactness: test_qwen3_next_blocks.py (`any_model`)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Qwen3_5MoeTextConfig, Qwen3_5TextConfig

from bloompeer import AutoDistributedModelForCausalLM
from bloompeer.blocks import open_checkpoint
from bloompeer.blocks.gated_deltanet import Qwen35GatedDeltaNet
from bloompeer.blocks.llama import SwiGLU
from bloompeer.blocks.moe import SparseMoe
from bloompeer.blocks.qwen3_next import QWEN3_NEXT, LinearAttentionBlock
from bloompeer.errors import RequestError

IDS = torch.randint(4, 250, (2, 20), generator=torch.Generator().manual_seed(0))
CONFIGS = {"qwen3_5": Qwen3_5TextConfig, "qwen3_5_moe": Qwen3_5MoeTextConfig}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_its_text_model_is_read_from_text_config_and_language_model(qwen3_5_checkpoints, model_type):
    path = qwen3_5_checkpoints[model_type]
    assert json.loads((path / "config.json").read_text())["model_type"] == model_type
    checkpoint = open_checkpoint(path)
    config = checkpoint.config()
    assert checkpoint.family is QWEN3_NEXT and type(config) is CONFIGS[model_type]
    assert config.num_hidden_layers == 4 and not config.tie_word_embeddings
    names = checkpoint.weight_map()
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight",
            "model.layers.0.linear_attn.in_proj_qkv.weight"} <= set(names)
    assert not any(name.startswith("model.language_model.") for name in names)
    assert any(name.startswith("model.visual.") for name in names)  # there, and never read
    client = checkpoint.load_tensors(QWEN3_NEXT.client_tensor_prefixes, torch.float32, desc=None)
    assert set(client) == {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}


def test_each_variant_is_qwen3_next_with_its_differences(qwen3_5_checkpoints):
    """Qwen3.5's DeltaNet projections apart; Qwen3.5's MLPs dense, Qwen3.5-MoE's all sparse with a shared expert
    and a router that renormalizes (its config has no norm_topk_prob)."""
    dense, sparse = (open_checkpoint(qwen3_5_checkpoints[name]).load_span(0, 4, torch.float32)
                     for name in ("qwen3_5", "qwen3_5_moe"))
    for span in (dense, sparse):
        linear = [block for block in span.blocks if isinstance(block, LinearAttentionBlock)]
        assert len(linear) == 3 and all(isinstance(block.linear_attn, Qwen35GatedDeltaNet) for block in linear)
    assert all(type(block.feed_forward) is SwiGLU for block in dense.blocks)
    assert all(isinstance(block.feed_forward, SparseMoe) and block.feed_forward.shared_expert is not None
               for block in sparse.blocks)
    assert sparse.experts_of(sparse.config) == ((4, 2),) * 4 and dense.experts_of(dense.config) == ((0, 0),) * 4


@torch.no_grad()
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_client_holds_the_text_models_embeddings_final_norm_and_head(qwen3_5_checkpoints, model_type):
    """...those of transformers' multimodal class, whose text logits are its ForCausalLM's (the reference the
    swarm's tokens are compared with)."""
    path = qwen3_5_checkpoints[model_type]
    multimodal = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    text = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(text).__name__ == {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[model_type]
    torch.testing.assert_close(text(IDS).logits, multimodal(input_ids=IDS).logits, rtol=0, atol=0)
    checkpoint = open_checkpoint(path)
    ours = AutoDistributedModelForCausalLM.class_for(str(path))._with_local_tensors(
        checkpoint, checkpoint.config(), torch.float32, None, 0)
    text_model = multimodal.model.language_model
    assert torch.equal(ours.remote.embed(IDS), text_model.embed_tokens(IDS))
    hidden = torch.randn(2, 3, 64)
    assert torch.equal(ours.remote.final_norm(hidden), text_model.norm(hidden))
    assert torch.equal(ours.lm_head.weight, multimodal.lm_head.weight)


@torch.no_grad()
def test_images_are_refused_with_a_clear_error_before_any_session(qwen3_5_checkpoints):
    checkpoint = open_checkpoint(qwen3_5_checkpoints["qwen3_5_moe"])
    ours = AutoDistributedModelForCausalLM.class_for(str(qwen3_5_checkpoints["qwen3_5_moe"]))._with_local_tensors(
        checkpoint, checkpoint.config(), torch.float32, None, 0)
    pixels, grid = torch.zeros(4, 3, 4, 4), torch.tensor([[1, 2, 2]])
    with pytest.raises(RequestError, match="image_grid_thw, pixel_values: images, video and sound are not taken"):
        ours.generate(IDS[:1], pixel_values=pixels, image_grid_thw=grid, max_new_tokens=2)
    with pytest.raises(RequestError, match="pixel_values_videos"):
        ours(IDS[:1], pixel_values_videos=pixels)


def _stacked_experts_copy(path, directory):
    """The checkpoint with every block's experts stacked as transformers holds them (gate_up_proj [E, 2I, H],
    down_proj [E, H, I]), the layout vLLM's Qwen3.5-MoE loader also reads."""
    shutil.copytree(path, directory)
    weight_map = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors = load_file(shard)
        prefixes = {name.split("experts.")[0] + "experts." for name in tensors if ".mlp.experts." in name}
        for prefix in prefixes:
            count = len({name for name in tensors if name.startswith(prefix) and name.endswith(".down_proj.weight")})
            take = [[tensors.pop(f"{prefix}{j}.{part}.weight") for j in range(count)]
                    for part in ("gate_proj", "up_proj", "down_proj")]
            tensors[prefix + "gate_up_proj"] = torch.cat([torch.stack(take[0]), torch.stack(take[1])], dim=1)
            tensors[prefix + "down_proj"] = torch.stack(take[2])
        save_file(tensors, shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, shard.name)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        index.write_text(json.dumps(json.loads(index.read_text()) | {"weight_map": weight_map}))
    return directory


def test_experts_stored_stacked_load_as_stored_expert_by_expert(qwen3_5_checkpoints, tmp_path):
    """Qwen3.5-MoE's experts stacked (moe.py split_stacked_experts) load into the very blocks the per-expert
    layout gives, and transformers reads that checkpoint as the same model."""
    per_expert = qwen3_5_checkpoints["qwen3_5_moe"]
    stacked = _stacked_experts_copy(per_expert, tmp_path / "stacked")
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in open_checkpoint(stacked).weight_map())
    ours = open_checkpoint(stacked).load_span(0, 4, torch.float32).state_dict()
    expected = open_checkpoint(per_expert).load_span(0, 4, torch.float32).state_dict()
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[name], expected[name]) for name in expected)
    with torch.inference_mode():
        logits = [AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(IDS).logits
                  for path in (per_expert, stacked)]
    assert torch.equal(*logits)
