"""Reading a checkpoint of any served family: its config, its family, and only the tensors a peer needs.

A server holds a few blocks of a model that may be far larger than its disk, and a client holds
only the embeddings, the final norm and the LM head. Both read the safetensors index first, then
open only the shard files that hold their tensors: from a local directory, or from the Hugging Face
hub, in which case only those shards are downloaded (into the usual hub cache). A server's span
loads block by block, so that a block can be transformed (quantized) before the next is read.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from ..errors import RequestError
from .families import MULTIMODAL_CHECKPOINTS, TextModelOf, family_for_model_type
from .published_formats import dequantize_published, kept_as_stored
from .family import ModelFamily
from .span import BlockSpan, float32_parameter_names

__all__ = ["Checkpoint", "CheckpointError", "open_checkpoint"]

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(RequestError):
    """The checkpoint is missing, incomplete, or of a model bloompeer does not serve."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint in a local directory or on the hub; files are fetched on demand."""

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

    @cached_property
    def _config_json(self) -> dict:
        """config.json as stored, read once (a server asks for its config at run time too)."""
        try:
            config_json = json.loads(self.file("config.json").read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{self.name_or_path}: config.json is not JSON: {exc}") from None
        if not isinstance(config_json, dict):
            raise CheckpointError(f"{self.name_or_path}: config.json is not a JSON object")
        return config_json

    @cached_property
    def _multimodal(self) -> TextModelOf | None:
        """What to read of a multimodal checkpoint (served as its text model); None for a text model's."""
        return MULTIMODAL_CHECKPOINTS.get(self._config_json.get("model_type"))

    @cached_property
    def family(self) -> ModelFamily:
        model_type = self._config_json.get("model_type")
        try:
            if self._multimodal is not None:
                model_type = self._text_model_config().model_type
            return family_for_model_type(model_type)
        except ValueError as exc:
            raise CheckpointError(f"{self.name_or_path}: {exc}") from None

    @property
    def quantization_config(self) -> dict | None:
        """How the authors published its weights, if not in a float dtype (published_formats.py): in config.json,
        or in its text model's config (Kimi K2.5's)."""
        text_config = self._config_json.get("text_config")
        nested = text_config.get("quantization_config") if isinstance(text_config, dict) else None
        return self._config_json.get("quantization_config") or nested

    def config(self):
        """The model's transformers config (BloomConfig, LlamaConfig, Qwen3Config, ...; a multimodal checkpoint's
        text model's), a new object each call (callers may change theirs); CheckpointError if bloompeer cannot
        compute it exactly."""
        family = self.family
        if self._multimodal is not None:
            config = self._text_model_config()
        else:
            config = family.config_class(self._config_json["model_type"])(**copy.deepcopy(self._config_json))
        try:
            family.span_class.check_config(config)
        except ValueError as exc:
            raise CheckpointError(f"{self.name_or_path}: {exc}") from None
        return config

    def _text_model_config(self):
        """A multimodal checkpoint's text model's config as transformers reads it (its config class nests it),
        with the checkpoint's tie_word_embeddings: transformers' multimodal class ties its head by its own."""
        from transformers import AutoConfig  # config classes only

        try:
            outer = AutoConfig.for_model(**copy.deepcopy(self._config_json))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.name_or_path}: transformers cannot read its config.json: {exc}") from None
        config = outer.get_text_config()
        config.tie_word_embeddings = outer.tie_word_embeddings
        return config

    def weight_map(self) -> dict[str, str]:
        """Tensor name (as the family names it: without a stored prefix) -> shard file that holds it."""
        return {name: shard for name, (shard, _) in self._stored_names.items()}

    @cached_property
    def _stored_names(self) -> dict[str, tuple[str, str]]:
        """Tensor name -> (shard file, the name it is stored under)."""
        if self.has_file(INDEX_FILE):
            raw_map = json.loads(self.file(INDEX_FILE).read_text())["weight_map"]
        else:
            with safe_open(self.file(SINGLE_FILE), framework="pt") as f:
                raw_map = {name: SINGLE_FILE for name in f.keys()}
        return {self._family_name(name): (shard, name) for name, shard in raw_map.items()}

    def _family_name(self, stored: str) -> str:
        """A tensor's name as its family names it: a multimodal checkpoint's text model renamed (its other parts
        keep their names, which no family reads), a stored prefix dropped."""
        for stored_prefix, prefix in self._multimodal.renames if self._multimodal is not None else ():
            if stored.startswith(stored_prefix):
                stored = prefix + stored.removeprefix(stored_prefix)
                break
        family_prefix = self.family.stored_prefix
        return stored.removeprefix(family_prefix) if family_prefix else stored

    def fingerprint(self) -> str:
        """A digest of config.json as stored and of the tensor layout (names, shards).

        Every peer can compute it without reading other peers' shards, so servers announce it and
        clients refuse chains that mix checkpoints. It does not hash tensor values: two checkpoints
        with the same layout and different values are told apart only by their names. Nor does it
        depend on the peer's transformers: not on its defaults (the file, not a config object, is
        hashed), nor on the version that wrote the file (its "transformers_version" is left out).
        """
        config_json = {name: value for name, value in self._config_json.items() if name != "transformers_version"}
        digest = hashlib.sha256()
        digest.update(json.dumps(config_json, sort_keys=True).encode())
        digest.update(json.dumps(sorted(self.weight_map().items())).encode())
        return digest.hexdigest()[:16]

    def load_tensors(self, prefixes: tuple[str, ...], dtype: torch.dtype, desc: str | None,
                     float32_names: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Load every tensor whose name starts with one of `prefixes`, opening only their shards (with a
        progress bar named `desc`, or none), in `dtype` (a published format's codes as stored; those named in
        `float32_names` in float32)."""
        by_shard: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for name, (shard, stored) in self._stored_names.items():
            if name.startswith(prefixes):
                by_shard[shard].append((name, stored))
        total = sum(len(names) for names in by_shard.values())
        logger.debug("Loading %s: %d tensors from %d shard(s) of %s", desc, total, len(by_shard), self.name_or_path)
        tensors = {}
        with tqdm(total=total, desc=desc, unit="tensor", disable=None if desc else True, leave=False) as progress:
            for shard, names in sorted(by_shard.items()):
                with safe_open(self.file(shard), framework="pt") as f:
                    for name, stored in names:
                        tensor = f.get_tensor(stored)
                        cast = torch.float32 if name in float32_names else dtype
                        tensors[name] = tensor if kept_as_stored(name, tensor) else tensor.to(cast)
                        progress.update()
        return tensors

    def load_span(self, start: int, end: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                  prepare_block: Callable[[nn.Module], None] | None = None) -> BlockSpan:
        """Blocks [start, end) of this model, read block by block from the shards that hold them.

        prepare_block (a quantizer, say) runs on each block once its weights are in place, before
        the next block is read, so the span's float weights never sit in memory all at once."""
        family, config = self.family, self.config()
        with torch.device("meta"):
            span = family.span_class(config, start, end)
        logger.info("Loading blocks %d:%d of %s", start, end, self.name_or_path)
        blocks = tqdm(zip(range(start, end), span.blocks), total=end - start, desc=f"blocks {start}:{end}",
                      unit="block", disable=None, leave=False)
        for index, block in blocks:
            prefix = family.block_prefix(index)
            float32 = frozenset(prefix + name for name in float32_parameter_names(block))
            tensors = self.load_tensors((prefix,), dtype, desc=None, float32_names=float32)
            state = {name.removeprefix(prefix): tensor for name, tensor in tensors.items()}
            try:
                state = span.block_state(dequantize_published(state, self.quantization_config, dtype))
            except ValueError as exc:
                raise CheckpointError(f"{self.name_or_path}: block {index}: {exc}") from None
            try:
                block.load_state_dict(state, strict=True, assign=True)
            except RuntimeError as exc:
                raise CheckpointError(f"{self.name_or_path}: block {index}'s tensors do not fit the config: {exc}") \
                    from None
            del tensors, state  # the block holds its tensors now: a quantizer below can free the float ones
            block.to(device).eval().requires_grad_(False)
            if prepare_block is not None:
                prepare_block(block)
        return span.eval().requires_grad_(False)


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
