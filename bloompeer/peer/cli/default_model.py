"""Models that need no download: the bundled demo model, and random-weight checkpoints.

The demo model (bloompeer/demo_model, trained by scripts/train_demo_model.py on Jane Austen's
novels) is what `generate`, `serve` and `status` use when no --model is given; its draft model
(bloompeer/demo_model/draft, distilled from it by scripts/train_draft_model.py) is what
`generate --draft-model demo` uses for speculative decoding. Random-weight
checkpoints of any size, with a byte-level tokenizer, are for tests and benchmarks.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEMO_DRAFT_MODEL_DIR", "DEMO_MODEL_DIR", "write_byte_tokenizer", "write_random_checkpoint"]

DEMO_MODEL_DIR = Path(__file__).resolve().parents[2] / "demo_model"
DEMO_DRAFT_MODEL_DIR = DEMO_MODEL_DIR / "draft"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


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


def write_random_checkpoint(directory: Path, *, model_type: str = "bloom", num_blocks: int = 4, hidden_size: int = 64,
                            num_heads: int = 4, vocab_size: int | None = None, seed: int = 0,
                            max_shard_size: str = "5MB", dtype: str = "float32", initializer_range: float = 0.02,
                            **config_fields) -> Path:
    """Save a random-weight model (sharded safetensors) with the byte-level tokenizer.

    model_type: "bloom", or one of the Llama family's ("llama", "mistral", "qwen2", "qwen3"), whose
    config takes `config_fields` too (num_key_value_heads, head_dim, rope_parameters, sliding_window,
    tie_word_embeddings, ...; num_key_value_heads defaults to half the heads (all for DeepSeek-V3),
    intermediate_size to 3 x hidden). initializer_range: the weights' std; transformers' default 0.02 makes a model that mostly
    repeats its last token, a larger one (0.1 and up) a model whose next token depends on the context."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_vocab = write_byte_tokenizer(directory)
    common = dict(vocab_size=vocab_size or tokenizer_vocab, hidden_size=hidden_size, num_hidden_layers=num_blocks,
                  num_attention_heads=num_heads, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  initializer_range=initializer_range)
    if model_type != "bloom":  # latent attention (DeepSeek-V3's) has as many key/value heads as heads
        kv_heads = num_heads if model_type == "deepseek_v3" else max(1, num_heads // 2)
        common.update(num_key_value_heads=kv_heads, intermediate_size=3 * hidden_size)
    config = AutoConfig.for_model(model_type, **(common | config_fields))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype)).eval()
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    return directory
