"""The model `bloompeer generate` uses when none is named: a tiny random-weight BLOOM.

It is created once in the cache directory, with a byte-level tokenizer, so that a fresh
machine with no network can run the whole system. Its text is gibberish by construction.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from .paths import cache_dir

__all__ = ["default_model_dir", "ensure_default_model", "write_byte_tokenizer", "write_random_checkpoint"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "tiny-random-bloom"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def write_byte_tokenizer(directory: Path) -> int:
    """A byte-level tokenizer with no merges: one token per byte plus specials. Returns its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *sorted(alphabet)])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return len(vocab)


def write_random_checkpoint(directory: Path, *, num_blocks: int = 4, hidden_size: int = 64, num_heads: int = 4,
                            vocab_size: int | None = None, seed: int = 0, max_shard_size: str = "5MB",
                            dtype: str = "float32") -> Path:
    """Save a random-weight BLOOM (sharded safetensors) with the byte-level tokenizer."""
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = write_byte_tokenizer(directory)
    config = BloomConfig(vocab_size=vocab_size or tokenizer_vocab, hidden_size=hidden_size, n_layer=num_blocks,
                         n_head=num_heads, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = BloomForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory


def ensure_default_model() -> Path:
    directory = default_model_dir()
    if not (directory / "config.json").is_file():
        logger.info("Creating the default model, a tiny random-weight BLOOM (its output is gibberish), in %s",
                    directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
        write_random_checkpoint(partial)
        try:
            partial.rename(directory)
        except OSError:  # another process created it first
            shutil.rmtree(partial, ignore_errors=True)
    return directory
