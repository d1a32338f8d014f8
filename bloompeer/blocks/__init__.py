"""What is computed: the blocks of every served model family, their KV cache and their weights.
Plain torch; no network.

One module per family (bloom.py, llama.py) says what differs; span.py is the loop they share,
family.py what the rest of bloompeer asks a family, families.py which families there are.
"""

from .checkpoint import Checkpoint, CheckpointError, open_checkpoint
from .families import FAMILIES, family_for_model_type, served_model_types
from .family import ClientParts, ModelFamily
from .kv_cache import SessionCache, token_positions
from .quantized_linear import (
    check_int4_shape, check_kernels, int8_cuda_arithmetic_on, quantize_block, stored_weight_nbytes,
)
from .rope import ROPE_TYPES
from .span import BlockSpan, Segment, float32_parameter_names

__all__ = [
    "BlockSpan", "Checkpoint", "CheckpointError", "ClientParts", "FAMILIES", "ModelFamily", "ROPE_TYPES", "Segment",
    "SessionCache", "check_int4_shape", "check_kernels", "family_for_model_type", "float32_parameter_names",
    "int8_cuda_arithmetic_on", "open_checkpoint", "quantize_block", "served_model_types", "stored_weight_nbytes",
    "token_positions",
]
