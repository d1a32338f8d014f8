"""What is computed: BLOOM blocks, their KV cache and their weights. Plain torch (and numpy's BLAS); no network."""

from .batched_linear import set_blas_threads
from .checkpoint import CLIENT_TENSOR_PREFIXES, Checkpoint, CheckpointError, block_prefix, open_checkpoint
from .kv_cache import SessionCache
from .span import BlockSpan, Segment, attention_bias

__all__ = [
    "BlockSpan", "Checkpoint", "CheckpointError", "CLIENT_TENSOR_PREFIXES", "Segment", "SessionCache",
    "attention_bias", "block_prefix", "open_checkpoint", "set_blas_threads",
]
