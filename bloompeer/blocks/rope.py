"""Rotary position embeddings (RoPE) of the Llama family: the frequencies of each rope type, and the
cos/sin a step's tokens are rotated with.

A server computes them from each session's own positions, which it derives from the session's
padding mask (a token's position is the count of real tokens before it, as transformers' generate
counts them), so nothing about positions crosses the wire but where a step starts. The frequencies
follow `config.rope_parameters` as transformers (5.x) standardises it; the types served are
default, linear, dynamic, yarn and llama3. Arithmetic is in float32 and in transformers' order, so
that cos and sin are bitwise its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["ROPE_TYPES", "RotaryFrequencies", "rope_frequencies", "rotate_half"]

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """1 / theta^(2i / dim) for i < dim / 2: the original RoPE frequencies."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _linear(params: dict, dim: int, max_positions: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency divided by the factor."""
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    inv_freq /= params["factor"]
    return inv_freq, 1.0


def _dynamic(params: dict, dim: int, max_positions: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Dynamic NTK at its trained length: the original frequencies (a grown base is computed on the device
    from the session's length, RotaryFrequencies.dynamic_inv_freq)."""
    return _base_inv_freq(params["rope_theta"], dim), 1.0


def _yarn(params: dict, dim: int, max_positions: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023): low frequencies interpolated, high ones kept, a linear ramp between,
    and cos/sin scaled by an attention factor."""
    base, factor = params["rope_theta"], params["factor"]
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_positions / original

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        weight, weight_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, weight) / mscale(factor, weight_all)) if weight and weight_all \
            else mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times in `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    position_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / position_freqs, 1.0 / (factor * position_freqs)
    keep = 1 - ramp.to(dtype=torch.float)
    return interpolated * (1 - keep) + extrapolated * keep, attention_factor


def _llama3(params: dict, dim: int, max_positions: int, seq_len: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1's scaling: long wavelengths divided by the factor, short ones kept, smooth between."""
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelength, high_wavelength = old_context / low, old_context / high
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
    return torch.where(medium, smoothed, scaled), 1.0


def _default(params: dict, dim: int, max_positions: int, seq_len: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], dim), 1.0


_COMPUTE = {"default": _default, "linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "llama3": _llama3}


@dataclass(frozen=True)
class RotaryFrequencies:
    """The rotation of one model: which type, over how many dimensions, trained for how long.

    Every type but dynamic has one set of frequencies. Dynamic's depend on the longest sequence
    seen so far (transformers keeps that length on its model; a server keeps it per session, which
    is what a freshly loaded transformers model computes for one generation), so `cos_sin` takes it.
    """

    params: dict
    dim: int
    max_positions: int
    # device -> (frequencies there, in float32; scaling), dynamic's at its trained length: made once, so
    # that a pass neither recomputes them on the host nor copies them to a GPU (a copy a CUDA graph cannot hold)
    _on_device: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def rope_type(self) -> str:
        return self.params["rope_type"]

    def inv_freq(self) -> tuple[torch.Tensor, float]:
        """(frequencies [dim / 2], attention scaling); dynamic's at its trained length."""
        return _COMPUTE[self.rope_type](self.params, self.dim, self.max_positions, self.max_positions)

    def dynamic_length(self, cached: torch.Tensor, seq_len: torch.Tensor) -> torch.Tensor:
        """Dynamic rope's length after a step that reaches seq_len, from the length cached before (0: none yet),
        both device tensors []: transformers grows it past the trained length and resets it when a sequence
        shorter than that comes after a longer one. Any length up to the trained one gives the original
        frequencies, so starting from 0 rather than from that length changes nothing."""
        grown = torch.maximum(cached, seq_len)
        return torch.where((seq_len < self.max_positions) & (grown > self.max_positions), self.max_positions, grown)

    def dynamic_inv_freq(self, length: torch.Tensor) -> torch.Tensor:
        """Dynamic rope's frequencies for a sequence whose longest length so far is `length` (a device tensor []):
        past the trained length the base grows with it. Computed on the device, in transformers' arithmetic
        (its grown base from a tensor length, in float32), without reading the length back to the host, so
        that a static step (step_graphs.py) computes them too."""
        original, _ = self._inv_freq_on(length.device)
        factor, dim = self.params["factor"], self.dim
        base = self.params["rope_theta"] * ((factor * length / self.max_positions) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=length.device).to(dtype=torch.float) / dim
        return torch.where(length > self.max_positions, 1.0 / (base ** exponents), original)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                seen_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [batch, tokens, dim] for positions [batch, tokens], in transformers' arithmetic;
        seen_length: dynamic rope's longest length so far (dynamic_length)."""
        inv_freq, scaling = self._inv_freq_on(positions.device)
        if seen_length is not None:
            inv_freq = self.dynamic_inv_freq(seen_length)
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * scaling).to(dtype), (angles.sin() * scaling).to(dtype)

    def _inv_freq_on(self, device: torch.device) -> tuple[torch.Tensor, float]:
        if device not in self._on_device:
            inv_freq, scaling = self.inv_freq()
            self._on_device[device] = inv_freq.to(device=device, dtype=torch.float), scaling
        return self._on_device[device]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[-second half, first half]: the rotation's sine term, as transformers writes it."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_frequencies(config, head_dim: int, partial: bool = False) -> RotaryFrequencies:
    """The model's rotation, from its (standardised) config.rope_parameters; ValueError for a rope
    type or a per-layer-type rope that bloompeer does not serve, or a partial rotary factor where the
    family's attention rotates whole heads (`partial`: it rotates the first `dim` of each head)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_type" not in params:
        raise ValueError("the config has no rope_parameters with a rope_type (a transformers 5 config of this "
                         "family always has them)")
    if params["rope_type"] not in ROPE_TYPES:
        raise ValueError(f"rope type {params['rope_type']!r} is not served (served: {', '.join(ROPE_TYPES)})")
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    if dim != head_dim and not partial:
        raise ValueError("a partial rotary factor below 1 is not served")
    return RotaryFrequencies(params, dim, config.max_position_embeddings)
