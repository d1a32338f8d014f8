"""Reading a BLOOM checkpoint: its config, and only the tensors a peer needs.

A server holds a few blocks of a model that may be far larger than its disk, and a client holds
only the embeddings and the final layernorm. Both read the safetensors index first, then open
only the shard files that hold their tensors: from a local directory, or from the Hugging Face
hub, in which case only those shards are downloaded (into the usual hub cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm
from transformers import BloomConfig

from ..errors import RequestError

__all__ = ["Checkpoint", "CheckpointError", "open_checkpoint", "block_prefix", "CLIENT_TENSOR_PREFIXES"]

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Checkpoints saved from BloomForCausalLM prefix every name with "transformer."; those saved
# from BloomModel (bigscience/bloom-*) do not. Names are compared without it.
MODEL_PREFIX = "transformer."
# What a client loads: everything outside the blocks. lm_head is tied to the word embeddings.
CLIENT_TENSOR_PREFIXES = ("word_embeddings.", "word_embeddings_layernorm.", "ln_f.", "lm_head.")


class CheckpointError(RequestError):
    """The checkpoint is missing, incomplete or not a BLOOM model."""


def block_prefix(block_index: int) -> str:
    return f"h.{block_index}."


@dataclass(frozen=True)
class Checkpoint:
    """A BLOOM checkpoint in a local directory or on the hub; files are fetched on demand."""

    name_or_path: str
    local_dir: Path | None  # None: a hub repository
    revision: str | None = None
    cache_dir: str | None = None

    @property
    def model_uid(self) -> str:
        """The name under which the swarm announces this model's blocks on the DHT."""
        return Path(self.name_or_path.rstrip("/")).name

    def file(self, filename: str) -> Path:
        """Local path of one file of the checkpoint, downloading it from the hub if needed."""
        if self.local_dir is not None:
            path = self.local_dir / filename
            if not path.is_file():
                raise CheckpointError(f"{path} does not exist")
            return path
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        try:
            return Path(hf_hub_download(self.name_or_path, filename, revision=self.revision, cache_dir=self.cache_dir))
        except EntryNotFoundError as exc:
            raise CheckpointError(f"{self.name_or_path} has no file {filename}") from exc

    def has_file(self, filename: str) -> bool:
        if self.local_dir is not None:
            return (self.local_dir / filename).is_file()
        try:
            self.file(filename)
            return True
        except CheckpointError:
            return False

    def config(self) -> BloomConfig:
        config = BloomConfig.from_json_file(self.file("config.json"))
        if config.model_type != "bloom":
            raise CheckpointError(f"{self.name_or_path} is a {config.model_type!r} model, not BLOOM")
        return config

    def weight_map(self) -> dict[str, str]:
        """Tensor name (without the "transformer." prefix) -> shard file that holds it."""
        if self.has_file(INDEX_FILE):
            raw_map = json.loads(self.file(INDEX_FILE).read_text())["weight_map"]
        else:
            with safe_open(self.file(SINGLE_FILE), framework="pt") as f:
                raw_map = {name: SINGLE_FILE for name in f.keys()}
        return {name.removeprefix(MODEL_PREFIX): shard for name, shard in raw_map.items()}

    def fingerprint(self) -> str:
        """A digest of the config and of the tensor layout (names, shards), plus the hub revision.

        Every peer can compute it without reading other peers' shards, so servers announce it and
        clients refuse chains that mix checkpoints. It does not hash tensor values: two checkpoints
        with the same layout and different values are told apart only by their names.
        """
        digest = hashlib.sha256()
        digest.update(json.dumps(self.config().to_diff_dict(), sort_keys=True).encode())
        digest.update(json.dumps(sorted(self.weight_map().items())).encode())
        return digest.hexdigest()[:16]

    def load_tensors(self, prefixes: tuple[str, ...], dtype: torch.dtype, desc: str) -> dict[str, torch.Tensor]:
        """Load every tensor whose name starts with one of `prefixes`, opening only their shards."""
        by_shard: dict[str, list[str]] = defaultdict(list)
        for name, shard in self.weight_map().items():
            if name.startswith(prefixes):
                by_shard[shard].append(name)
        total = sum(len(names) for names in by_shard.values())
        logger.info("Loading %s: %d tensors from %d shard(s) of %s", desc, total, len(by_shard), self.name_or_path)
        tensors = {}
        with tqdm(total=total, desc=desc, unit="tensor", disable=None, leave=False) as progress:
            for shard, names in sorted(by_shard.items()):
                with safe_open(self.file(shard), framework="pt") as f:
                    stored_names = set(f.keys())
                    for name in names:
                        stored = name if name in stored_names else MODEL_PREFIX + name
                        tensors[name] = f.get_tensor(stored).to(dtype)
                        progress.update()
        return tensors


def open_checkpoint(name_or_path: str | Path, revision: str | None = None, cache_dir: str | None = None) -> Checkpoint:
    """A local directory if one exists at that path, else a hub repository name."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
        return Checkpoint(str(name_or_path), path.resolve(), revision, cache_dir)
    if str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise CheckpointError(f"{name_or_path} is not a directory (and not a hub name like org/model)")
    return Checkpoint(str(name_or_path), None, revision, cache_dir)
