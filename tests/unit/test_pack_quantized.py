"""Kimi K2-Thinking's and K2.5's routed experts as published: INT4 in compressed-tensors' pack-quantized format
(bloompeer/blocks/pack_quantized.py), against the compressed-tensors package itself, the reference
implementation (its `unpack_from_int32` and `dequantize`, tests/helpers/pack_quantized.py): our weights are its
dequantized ones bit for bit, the memory plan counts what a server holds, and hostile files are refused at load
naming the tensor and what is wrong."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from bloompeer.blocks import CheckpointError, open_checkpoint, quantize_block
from bloompeer.peer.server.stored_blocks import StoredBlocks
from bloompeer.weight_format import WeightFormat

from ..helpers.pack_quantized import KIMI_INT4, reference_weight, write_pack_quantized_checkpoint

EXPERT = "model.layers.1.mlp.experts.5.gate_proj"  # [32, 64]: 2 groups of 32 inputs a row


# the same scheme in 8 bits: 4 codes a word
KIMI_INT8 = copy.deepcopy(KIMI_INT4)
KIMI_INT8["config_groups"]["group_0"]["weights"]["num_bits"] = 8
SCHEMES = {"deepseek_v3": KIMI_INT4, "kimi_k25": KIMI_INT4, "deepseek_v3-8bit": KIMI_INT8}


@pytest.fixture(scope="module")
def int4_checkpoints(deepseek_checkpoints, kimi_k25_checkpoint, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (a float checkpoint, its copy with routed experts pack-quantized as SCHEMES[name] says): DeepSeek-V3's
    layout (Kimi K2-Thinking's) and Kimi K2.5's multimodal one (language_model.*, the quantization_config in
    text_config)."""
    root = tmp_path_factory.mktemp("int4")
    floats = {"deepseek_v3": deepseek_checkpoints["deepseek_v3"], "kimi_k25": kimi_k25_checkpoint,
              "deepseek_v3-8bit": deepseek_checkpoints["deepseek_v3"]}
    return {name: (path, write_pack_quantized_checkpoint(path, root / name, SCHEMES[name]))
            for name, path in floats.items()}


def _stored_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            tensors |= {name.removeprefix("language_model."): f.get_tensor(name) for name in f.keys()}
    return tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(SCHEMES))
@torch.no_grad()
def test_int4_experts_load_as_compressed_tensors_dequantizes_them(int4_checkpoints, name, dtype):
    """Every routed expert's weight equals the package's dequantization of the stored tensors, bit for bit; the
    modules in `ignore` (attention, shared experts, the dense block) are the float checkpoint's as stored."""
    float_path, int4_path = int4_checkpoints[name]
    stored = _stored_tensors(int4_path)
    packed = stored[f"{EXPERT}.weight_packed"]
    bits = SCHEMES[name]["config_groups"]["group_0"]["weights"]["num_bits"]
    assert packed.dtype == torch.int32 and list(packed.shape) == [32, 64 * bits // 32]  # 8 codes a word (int4)
    assert stored[f"{EXPERT}.weight_scale"].dtype == torch.bfloat16 and f"{EXPERT}.weight" not in stored
    span = open_checkpoint(int4_path).load_span(0, 4, dtype)
    floats = open_checkpoint(float_path).load_span(0, 4, dtype)
    experts = 0
    for index in range(1, 4):
        for expert, (mine, plain) in enumerate(zip(span.blocks[index].feed_forward.experts,
                                                   floats.blocks[index].feed_forward.experts)):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                module = f"model.layers.{index}.mlp.experts.{expert}.{projection}"
                expected = reference_weight(stored, module, SCHEMES[name], dtype)
                ours = getattr(mine, projection).weight
                assert ours.dtype == dtype and torch.equal(ours, expected), module
                error = (ours.float() - getattr(plain, projection).weight.float()).norm()
                assert 0 < error < 0.2 * getattr(plain, projection).weight.float().norm()  # rounded, not garbled
                experts += 1
    assert experts == 3 * 8 * 3
    ours, theirs = span.blocks[2], floats.blocks[2]
    assert torch.equal(ours.self_attn.kv_b_proj.weight, theirs.self_attn.kv_b_proj.weight)
    assert torch.equal(ours.feed_forward.shared_experts.down_proj.weight,
                       theirs.feed_forward.shared_experts.down_proj.weight)
    assert torch.equal(span.blocks[0].feed_forward.up_proj.weight, floats.blocks[0].feed_forward.up_proj.weight)


def _nbytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("weights", [WeightFormat(dtype="bfloat16"), WeightFormat("int8", dtype="bfloat16")],
                         ids=["bfloat16", "int8"])  # (--quant int4's kernels cannot take q_a_proj's 24 rows)
@torch.no_grad()
def test_the_memory_plan_counts_int4_experts_as_the_server_holds_them(int4_checkpoints, weights):
    """Dequantized into --dtype, or quantized again under --quant: the plan (from the config) counts each block as
    the float checkpoint's, and as the block loaded from the INT4 files really holds it."""
    float_path, int4_path = int4_checkpoints["deepseek_v3"]
    checkpoint = open_checkpoint(int4_path)
    planned = StoredBlocks(checkpoint, weights).block_nbytes
    assert planned == StoredBlocks(open_checkpoint(float_path), weights).block_nbytes
    prepare = (lambda block: quantize_block(block, weights)) if weights.quantized else None
    span = checkpoint.load_span(0, 4, torch.bfloat16, prepare_block=prepare)
    assert [_nbytes(block) for block in span.blocks] == list(planned)


def _edited(path: Path, tmp_path: Path, tensors: dict | None = None, config: dict | None = None) -> Path:
    """A copy of the checkpoint at `path` with `tensors` (name -> a tensor, or None to drop it) written into
    the shard that holds each name (or the first), and `config`'s fields set in its quantization_config's weights."""
    copy = tmp_path / "edited"
    shutil.copytree(path, copy)
    index_path = copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for name, tensor in (tensors or {}).items():
        shard = copy / index["weight_map"].get(name, min(index["weight_map"].values()))
        with safe_open(shard, framework="pt") as f:
            stored = {key: f.get_tensor(key) for key in f.keys()}
        stored.pop(name, None)
        if tensor is None:
            del index["weight_map"][name]
        else:
            stored[name] = tensor
            index["weight_map"][name] = shard.name
        save_file(stored, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    config_json = json.loads((copy / "config.json").read_text())
    config_json["quantization_config"]["config_groups"]["group_0"]["weights"].update(config or {})
    (copy / "config.json").write_text(json.dumps(config_json))
    return copy


_HOSTILE_TENSORS = {
    "packed as float": ({"weight_packed": torch.zeros(32, 8)},
                        "gate_proj.weight_packed is torch.float32 \\[32, 8\\]; 4-bit codes of a \\[32, 64\\] weight "
                        "are int32 \\[32, 8\\]"),
    "packed too short": ({"weight_packed": torch.zeros(32, 7, dtype=torch.int32)},
                         "weight_packed is torch.int32 \\[32, 7\\]"),
    "scale of integers": ({"weight_scale": torch.ones(32, 2, dtype=torch.int32)},
                          "gate_proj.weight_scale is torch.int32 \\[32, 2\\]; its groups of 32 columns take a float "
                          "tensor \\[32, 2\\]"),
    "scale per row": ({"weight_scale": torch.ones(32, 1)}, "weight_scale is torch.float32 \\[32, 1\\]"),
    "shape of floats": ({"weight_shape": torch.tensor([32.0, 64.0])},
                        "gate_proj.weight_shape is torch.float32 \\[2\\]; it is an integer \\[rows, columns\\]"),
    "shape of three": ({"weight_shape": torch.tensor([32, 64, 1])}, "weight_shape is torch.int64 \\[3\\]"),
    "negative shape": ({"weight_shape": torch.tensor([32, -64])}, "weight_shape is torch.int64 \\[2\\]"),
    "group does not divide": ({"weight_shape": torch.tensor([32, 60])},
                              "gate_proj: group_size 32 does not divide its 60 columns"),
    "no scale": ({"weight_scale": None}, "gate_proj.weight_packed comes without .*gate_proj.weight_scale"),
    "packed and plain": ({"weight": torch.zeros(32, 64)}, "gate_proj is stored both packed and as .*gate_proj.weight"),
    "a zero point": ({"weight_zero_point": torch.zeros(4, 2, dtype=torch.int32)},
                     "gate_proj.weight_zero_point: asymmetric weights are not read"),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_TENSORS))
def test_hostile_int4_tensors_are_refused_at_load_naming_the_tensor(int4_checkpoints, tmp_path, case):
    edits, message = _HOSTILE_TENSORS[case]
    path = _edited(int4_checkpoints["deepseek_v3"][1], tmp_path,
                   tensors={f"{EXPERT}.{suffix}": tensor for suffix, tensor in edits.items()})
    with pytest.raises(CheckpointError, match=f"block 1: .*{message}"):
        open_checkpoint(path).load_span(0, 4, torch.float32)


@pytest.mark.parametrize("weights, message", [
    ({"num_bits": 3}, "weights of type 'int', num_bits 3 are not read by bloompeer \\(it reads int, num_bits 4 "
                      "or 8\\)"),
    ({"num_bits": 4.0}, "weights of type 'int', num_bits 4.0 are not read"),
    ({"type": "float"}, "weights of type 'float', num_bits 4 are not read"),
    ({"strategy": "block"}, "weights of strategy 'block' are not read by bloompeer \\(it reads group, channel\\)"),
    ({"group_size": 0}, "group_size 0 is not a positive integer"),
    ({"symmetric": False}, "asymmetric weights \\(symmetric: false, weight_zero_point\\) are not read"),
], ids=["num_bits", "num_bits-float", "type", "strategy", "group_size", "symmetric"])
def test_int4_schemes_not_read_here_are_refused_naming_the_field(int4_checkpoints, tmp_path, weights, message):
    path = _edited(int4_checkpoints["deepseek_v3"][1], tmp_path, config=weights)
    with pytest.raises(CheckpointError, match=f"block 0: compressed-tensors {message}"):
        open_checkpoint(path).load_span(0, 4, torch.float32)


def test_other_compressed_tensors_formats_are_refused_naming_them(int4_checkpoints, tmp_path):
    path = _edited(int4_checkpoints["deepseek_v3"][1], tmp_path)
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (path / "config.json").write_text(json.dumps(config_json))
    with pytest.raises(CheckpointError, match="format \\['nvfp4-pack-quantized'\\] is not read by bloompeer"):
        open_checkpoint(path).load_span(0, 1, torch.float32)

