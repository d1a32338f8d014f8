"""The hub code path (huggingface_hub's cache and download functions), exercised offline through a
local hub cache that holds only some shards: what a server needs must be all it asks for."""

import json
import shutil

import huggingface_hub.constants
import pytest
import torch
import transformers.configuration_utils

from bloompeer.blocks import CheckpointError, open_checkpoint
from bloompeer.blocks.bloom import BLOOM

REPO = "bloompeer-test/tiny-bloom"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def partial_hub_cache(tiny_checkpoint, tmp_path, monkeypatch):
    """A hub cache with the config, the index and only the shards holding blocks 2 and 3."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no test touches the network
    repo_dir = tmp_path / f"models--{REPO.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(COMMIT)
    weight_map = open_checkpoint(tiny_checkpoint).weight_map()
    needed = {shard for name, shard in weight_map.items() if name.startswith((BLOOM.block_prefix(2), BLOOM.block_prefix(3)))}
    for path in tiny_checkpoint.iterdir():
        if path.suffix != ".safetensors" or path.name in needed:
            shutil.copy(path, snapshot / path.name)
    return tmp_path


def test_a_hub_name_loads_from_the_hub_cache(partial_hub_cache, reference_model):
    checkpoint = open_checkpoint(REPO, cache_dir=str(partial_hub_cache))
    assert checkpoint.local_dir is None and checkpoint.model_uid == "tiny-bloom"
    span = checkpoint.load_span(2, 4, torch.float32)
    expected = reference_model.transformer.h[3].state_dict()
    assert all(torch.equal(t, expected[n]) for n, t in span.blocks[1].state_dict().items())


def test_a_missing_shard_is_a_clear_error(partial_hub_cache):
    checkpoint = open_checkpoint(REPO, cache_dir=str(partial_hub_cache))
    with pytest.raises(CheckpointError, match="has no file"):
        checkpoint.load_span(0, 1, torch.float32)


def test_fingerprint_is_the_same_from_the_hub_and_from_a_directory(partial_hub_cache, tiny_checkpoint):
    assert open_checkpoint(REPO, cache_dir=str(partial_hub_cache)).fingerprint() == \
        open_checkpoint(tiny_checkpoint).fingerprint()


def test_fingerprint_ignores_transformers_versions_not_the_configs_values(tiny_checkpoint, tmp_path, monkeypatch):
    """Volunteers run different transformers releases; their servers of one checkpoint must agree."""
    def copy_with(**fields) -> str:
        path = tmp_path / f"copy-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_checkpoint, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | fields))
        return open_checkpoint(path).fingerprint()

    original = open_checkpoint(tiny_checkpoint).fingerprint()
    monkeypatch.setattr(transformers.configuration_utils, "__version__", "9.9.9")  # the running release
    assert open_checkpoint(tiny_checkpoint).fingerprint() == original
    assert copy_with(transformers_version="4.0.0") == original  # the release that wrote the file
    assert copy_with(layer_norm_epsilon=1e-3) != original


@pytest.mark.parametrize("name", ["./no-such-dir", "/abs/missing", "a/b/c"])
def test_paths_that_are_not_checkpoints(name):
    with pytest.raises(CheckpointError):
        open_checkpoint(name)


def test_weights_published_in_a_format_not_read_here_are_refused_naming_it(tiny_checkpoint, tmp_path):
    copy = tmp_path / "awq"
    shutil.copytree(tiny_checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(CheckpointError, match="block 0: weights published as 'awq' are not read by bloompeer"):
        open_checkpoint(copy).load_span(0, 1, torch.float32)
