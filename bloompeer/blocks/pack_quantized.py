"""Weights published in compressed-tensors' "pack-quantized" format, read into the served dtype as a block loads.

Kimi K2-Thinking and Kimi K2.5 ship their routed experts so (`quantization_config`: quant_method
"compressed-tensors", format "pack-quantized", one config group whose weights are int, num_bits 4,
symmetric, strategy "group", group_size 32). The modules in its `ignore` list (attention, shared
experts, dense layers, the LM head) are stored as usual and read as such: which layers are packed is
what the files hold, as it is for FP8. A packed linear weight X [rows, columns] is stored as

    X.weight_packed  int32 [rows, ceil(columns * bits / 32)]: 32 / bits codes a word along the columns,
                     the first in the lowest bits, each as code + 2^(bits - 1) (code in [-2^(bits-1), 2^(bits-1)))
    X.weight_scale   float [rows, columns / group_size] (bfloat16 in Kimi's files); strategy "channel": [rows, 1]
    X.weight_shape   integer [2]: rows, columns

and X = code x scale, multiplied in float32 (exact: a code has at most 8 bits, a bfloat16 scale 8) and cast
once to the dtype. That is compressed-tensors' own `unpack_from_int32` and `dequantize` bit for bit
(tests/unit/test_pack_quantized.py runs the package on the same files), whose product is in the scale's
dtype: bfloat16 with the scale as stored, float32 with the scale cast to float32 (exact either way).
num_bits 8 is the same layout, 4 codes a word. Asymmetric weights (weight_zero_point), activation
quantization and other formats of compressed-tensors are refused by name, not guessed at.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackQuantized", "STORED_SUFFIXES"]

_PACKED, _SCALE, _SHAPE, _ZERO_POINT = ".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point"
STORED_SUFFIXES = (_PACKED, _SCALE, _SHAPE, _ZERO_POINT)  # what a loader keeps as stored: codes, scales, shapes
_BITS = (4, 8)  # the widths whose layout is a whole number of codes a word (every compressed-tensors version's)
_STRATEGIES = ("group", "channel")
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class PackQuantized:
    """One pack-quantized scheme: `bits` per code, one scale per `group_size` columns of a row (None: per row)."""

    bits: int
    group_size: int | None

    @classmethod
    def of(cls, quantization_config: dict) -> PackQuantized:
        """The scheme config.json's quantization_config names; ValueError naming the field bloompeer does not read."""
        formats = {quantization_config.get("format")} | {group.get("format") for group in _groups(quantization_config)}
        if formats - {None, "pack-quantized"}:
            raise ValueError(f"compressed-tensors format {sorted(map(str, formats - {None}))} is not read by "
                             f"bloompeer (it reads pack-quantized)")
        schemes = {repr(sorted(group["weights"].items())): group for group in _groups(quantization_config)}
        if len(schemes) != 1:
            raise ValueError(f"compressed-tensors config_groups: {len(schemes)} different weight schemes "
                             f"(bloompeer reads one)")
        group = next(iter(schemes.values()))
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError("compressed-tensors config_groups quantize activations too, which bloompeer does not "
                             "compute (it reads weight-only schemes)")
        return cls._of_weights(group["weights"])

    @classmethod
    def _of_weights(cls, weights: dict) -> PackQuantized:
        bits, strategy, group_size = weights.get("num_bits"), weights.get("strategy"), weights.get("group_size")
        if weights.get("type", "int") != "int" or type(bits) is not int or bits not in _BITS:
            raise ValueError(f"compressed-tensors weights of type {weights.get('type')!r}, num_bits {bits!r} are not "
                             f"read by bloompeer (it reads int, num_bits {' or '.join(map(str, _BITS))})")
        if strategy not in _STRATEGIES:
            raise ValueError(f"compressed-tensors weights of strategy {strategy!r} are not read by bloompeer "
                             f"(it reads {', '.join(_STRATEGIES)})")
        if weights.get("symmetric") is False:
            raise ValueError("compressed-tensors asymmetric weights (symmetric: false, weight_zero_point) are not "
                             "read by bloompeer")
        if strategy == "channel":
            return cls(bits, None)
        if type(group_size) is not int or group_size <= 0:
            raise ValueError(f"compressed-tensors group_size {group_size!r} is not a positive integer")
        return cls(bits, group_size)

    def dequantized(self, state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A block's tensors with every X.weight_packed (and its scale and shape) replaced by X.weight in `dtype`."""
        for name in [name for name in state if name.endswith(_ZERO_POINT)]:
            raise ValueError(f"{name}: asymmetric weights are not read by bloompeer (the config says symmetric)")
        for name in [name for name in state if name.endswith(_PACKED)]:
            module = name.removesuffix(_PACKED)
            missing = [module + suffix for suffix in (_SCALE, _SHAPE) if module + suffix not in state]
            if missing or module + ".weight" in state:
                raise ValueError(f"{name} comes without {missing}" if missing else f"{module} is stored both packed "
                                 f"and as {module}.weight")
            packed, scale, shape = (state.pop(module + suffix) for suffix in (_PACKED, _SCALE, _SHAPE))
            state[module + ".weight"] = self._weight(module, packed, scale, shape, dtype)
        leftover = sorted(name for name in state if name.endswith((_SCALE, _SHAPE)))
        if leftover:
            raise ValueError(f"{leftover[0]} has no {leftover[0].rsplit('.', 1)[0]}{_PACKED}")
        return state

    def _weight(self, module: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """X [rows, columns] in `dtype` from its stored tensors, each checked first (ValueError naming it)."""
        rows, columns = _shape(module + _SHAPE, shape)
        per_word = 32 // self.bits
        words = -(-columns // per_word)
        if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, words):
            raise ValueError(f"{module}{_PACKED} is {packed.dtype} {list(packed.shape)}; {self.bits}-bit codes of a "
                             f"[{rows}, {columns}] weight are int32 [{rows}, {words}]")
        group_size = self.group_size or columns
        if columns % group_size:
            raise ValueError(f"{module}: group_size {group_size} does not divide its {columns} columns")
        groups = (rows, columns // group_size)
        if scale.dtype not in _SCALE_DTYPES or tuple(scale.shape) != groups:
            raise ValueError(f"{module}{_SCALE} is {scale.dtype} {list(scale.shape)}; its groups of {group_size} "
                             f"columns take a float tensor {list(groups)}")
        shifts = torch.arange(0, 32, self.bits, dtype=torch.int32)
        codes = (packed[..., None] >> shifts) & ((1 << self.bits) - 1)  # [rows, words, per_word]
        codes = codes.flatten(1)[:, :columns] - (1 << (self.bits - 1))  # [rows, columns]
        scales = scale.float().repeat_interleave(group_size, dim=1)  # [rows, columns]
        return (codes.float() * scales).to(dtype)


def _groups(quantization_config: dict) -> list[dict]:
    """The config groups, each with its weights' scheme (an object); ValueError otherwise."""
    groups = quantization_config.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(
            isinstance(group, dict) and isinstance(group.get("weights"), dict) for group in groups.values()):
        raise ValueError("compressed-tensors quantization_config has no config_groups of weights")
    return list(groups.values())


def _shape(name: str, shape: torch.Tensor) -> tuple[int, int]:
    """rows, columns from X.weight_shape; ValueError unless an integer tensor of two positive values."""
    if shape.dtype.is_floating_point or shape.dtype.is_complex or shape.dtype == torch.bool or shape.numel() != 2 \
            or shape.ndim != 1 or bool((shape <= 0).any()) or bool((shape > 2**31 - 1).any()):
        raise ValueError(f"{name} is {shape.dtype} {list(shape.shape)}; it is an integer [rows, columns]")
    rows, columns = shape.tolist()
    return rows, columns
