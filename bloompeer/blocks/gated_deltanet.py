"""Gated DeltaNet, the linear attention of Qwen3-Next's and Qwen3.5's recurrent blocks, under the
names their checkpoints give it (`model.layers.{i}.linear_attn.*`), as transformers' torch code computes
it (`Qwen3NextGatedDeltaNet`, `Qwen3_5GatedDeltaNet`): padding zeroed, projections, the causal
convolution, the gated delta rule (delta_rule.py) with its decay g = -exp(A_log) * softplus(a + dt_bias)
and rate beta = sigmoid(b), the gated RMSNorm of its output, and the output projection.

Why split this way: the projections read all the weights, so they run once on every request's rows
(through the span's `linear` seam, like every other layer); the convolution and the rule run per
request from that session's own state (recurrent_state.py), in `mix`, which is also what re-advances
a state after a rollback, so both compute the same. Qwen3-Next interleaves its projections per key
head (`in_proj_qkvz`, `in_proj_ba`), Qwen3.5 does not (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`): the one difference between the two layers (`Qwen35GatedDeltaNet`).

A pass of a few tokens after a state (a speculative step: the accepted token and its drafts) runs as
that many one-token steps, each the very computation of a step (the convolution, sigmoid and the rule
round by their tensors' shapes, so only the same shapes give the same bits): each token's output and
state are then bitwise what plain greedy decoding computes, and a rollback re-advances the same way
(recurrent_state.py). transformers' assisted generation likewise runs its drafts with the recurrent
rule (`activate_past_recording`); its plain forward would chunk them (ours stays within 1e-5 of it).
Up to RECURRENT_PASS_TOKENS: measured on one block of Qwen3-Next's shapes (32 value heads of 128),
float32 on this 2-core CPU (benchmarks/recurrent_rollback.py and the same loop for other lengths,
minimum of 10 interleaved runs), a token's step computation takes 1.05 ms and the chunked algorithm,
padded to 64 tokens, 8.6 ms for 9 tokens and 8.9 ms for 16: 9 tokens as steps take 9.8 ms, 16 take
16.8 ms, 32 take 32 ms against 9.8. 16 covers prompt lookup's default 10 drafts and the demo draft
model's 6; a longer pass, or a prompt, runs the chunked algorithm as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .delta_rule import causal_conv, gated_delta_rule
from .recurrent_state import LayerStart, RecurrentLayout, RecurrentState
from .span import Linear

RECURRENT_PASS_TOKENS = 16  # the longest pass after a state that runs as one-token steps (see above)

__all__ = ["RECURRENT_PASS_TOKENS", "DeltaNetSegment", "GatedDeltaNet", "GatedRMSNorm", "Qwen35GatedDeltaNet", "recurrent_layout"]


def recurrent_layout(config) -> RecurrentLayout:
    """What a Gated DeltaNet block of this config keeps per session."""
    key_dim, value_dim = config.linear_num_key_heads * config.linear_key_head_dim, \
        config.linear_num_value_heads * config.linear_value_head_dim
    return RecurrentLayout(conv_dim=2 * key_dim + value_dim, conv_window=config.linear_conv_kernel_dim - 1,
                           heads=config.linear_num_value_heads, key_dim=config.linear_key_head_dim,
                           value_dim=config.linear_value_head_dim)


@dataclass
class DeltaNetSegment:
    """One request's part of a pass: `batch` x `num_new` rows, its session's state (None: a forward that
    keeps nothing, from a fresh state), and its new tokens' padding mask [batch, num_new] (False at
    padding; None: none)."""

    batch: int
    num_new: int
    state: RecurrentState | None = None
    padding_mask: torch.Tensor | None = None


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times silu(z): in float32, the weight applied in the input's
    dtype (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        hidden = self.weight * hidden.to(dtype)
        return (hidden * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention (a block's `linear_attn`)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not served (Gated DeltaNet's is silu)")
        self.layout = recurrent_layout(config)
        self.k_heads, self.k_dim = config.linear_num_key_heads, config.linear_key_head_dim
        self.v_heads, self.v_dim = config.linear_num_value_heads, config.linear_value_head_dim
        self.layer_idx = layer_idx
        conv_dim = self.layout.conv_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, bias=False, groups=conv_dim,
                                padding=config.linear_conv_kernel_dim - 1)
        self.make_projections(config.hidden_size)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.v_heads * self.v_dim, config.hidden_size, bias=False)

    def make_projections(self, hidden: int) -> None:
        key_dim, value_dim = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.in_proj_qkvz = nn.Linear(hidden, 2 * key_dim + 2 * value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden, 2 * self.v_heads, bias=False)

    def project(self, hidden: torch.Tensor, linear: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [..., hidden] -> (inputs [..., conv_dim + 2 v_heads]: the convolution's q, k, v, then b, a;
        z [..., v_heads, v_dim]), unpicked from the per-key-head layout (fix_query_key_value_ordering)."""
        qkvz, ba = linear(self.in_proj_qkvz, hidden), linear(self.in_proj_ba, hidden)
        lead, group = hidden.shape[:-1], self.v_heads // self.k_heads
        qkvz = qkvz.view(*lead, self.k_heads, 2 * self.k_dim + 2 * group * self.v_dim)
        ba = ba.view(*lead, self.k_heads, 2 * group)
        query, key, value, z = torch.split(qkvz, [self.k_dim, self.k_dim, group * self.v_dim, group * self.v_dim],
                                           dim=-1)
        b, a = torch.split(ba, [group, group], dim=-1)
        parts = [part.reshape(*lead, -1) for part in (query, key, value, b, a)]
        return torch.cat(parts, dim=-1), z.reshape(*lead, self.v_heads, self.v_dim)

    def compute(self, hidden: torch.Tensor, linear: Linear, segments: Sequence[DeltaNetSegment]) -> torch.Tensor:
        """The layer's output (before the residual) for one segment's hidden [batch, num_new, hidden] or
        several segments' rows [rows, hidden] (normed); each segment mixes from its own state."""
        hidden = self._padding_zeroed(hidden, segments)
        inputs, z = self.project(hidden, linear)
        if len(segments) == 1:
            core = self._segment(inputs, segments[0])
        else:
            parts = inputs.split([segment.batch * segment.num_new for segment in segments])
            core = torch.cat([self._segment(part.view(segment.batch, segment.num_new, -1), segment).flatten(0, 1)
                              for part, segment in zip(parts, segments)])
        lead = core.shape[:-2]
        core = self.norm(core.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim))
        return linear(self.out_proj, core.reshape(*lead, -1))

    def _segment(self, inputs: torch.Tensor, segment: DeltaNetSegment) -> torch.Tensor:
        """[batch, num_new, input_width] -> the rule's output [batch, num_new, v_heads, v_dim]."""
        if segment.state is None:
            return self.mix(inputs, None)[0]
        return segment.state.run(self.layer_idx, inputs, self.mix)

    def mix(self, inputs: torch.Tensor, start: LayerStart) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """From `start` (a window and a state, None when fresh), over inputs [batch, tokens, input_width]:
        (the rule's output [batch, tokens, v_heads, v_dim], (the window, the state) after them); a short
        pass after a state token by token (see the module's docstring)."""
        if start is None or not 1 < inputs.shape[1] <= RECURRENT_PASS_TOKENS:
            return self._mix_pass(inputs, start)
        outputs = []
        for index in range(inputs.shape[1]):
            output, start = self._mix_pass(inputs[:, index:index + 1], start)
            outputs.append(output)
        return torch.cat(outputs, dim=1), start

    def _mix_pass(self, inputs: torch.Tensor, start: LayerStart
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """mix in one pass, as transformers' layer computes it after its projections."""
        batch, length, _ = inputs.shape
        layout = self.layout
        mixed, b, a = torch.split(inputs, [layout.conv_dim, self.v_heads, self.v_heads], dim=-1)
        mixed = mixed.transpose(1, 2)  # [batch, conv_dim, tokens]
        window = None if start is None else start[0]
        convolved = causal_conv(mixed, window, self.conv1d.weight).transpose(1, 2)
        before = mixed.new_zeros(batch, layout.conv_dim, layout.conv_window) if window is None else window
        new_window = torch.cat([before, mixed], dim=-1)[..., -layout.conv_window:]
        key_dim = self.k_heads * self.k_dim
        query, key, value = torch.split(convolved, [key_dim, key_dim, self.v_heads * self.v_dim], dim=-1)
        query = query.reshape(batch, length, -1, self.k_dim)
        key = key.reshape(batch, length, -1, self.k_dim)
        value = value.reshape(batch, length, -1, self.v_dim)
        b, a = b.contiguous(), a.contiguous()  # as transformers' are (sigmoid rounds by layout)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        output, state = gated_delta_rule(query, key, value, g, beta, None if start is None else start[1])
        return output, (new_window, state)

    @staticmethod
    def _padding_zeroed(hidden: torch.Tensor, segments: Sequence[DeltaNetSegment]) -> torch.Tensor:
        """Padding rows zeroed (apply_mask_to_padding_states), as transformers does for a pass of several
        tokens with padding among them, so that padding leaves the state as it was."""
        masks = [segment.padding_mask if segment.padding_mask is not None and segment.num_new > 1
                 and not bool(segment.padding_mask.all()) else None for segment in segments]
        if all(mask is None for mask in masks):
            return hidden
        if len(segments) == 1:
            return (hidden * masks[0][:, :, None]).to(hidden.dtype)
        parts = hidden.split([segment.batch * segment.num_new for segment in segments])
        return torch.cat([part if mask is None else (part * mask.reshape(-1, 1)).to(hidden.dtype)
                          for part, mask in zip(parts, masks)])


class Qwen35GatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's: the same layer with its projections apart and in plain order."""

    def make_projections(self, hidden: int) -> None:
        key_dim, value_dim = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        self.in_proj_qkv = nn.Linear(hidden, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.v_heads, bias=False)

    def project(self, hidden: torch.Tensor, linear: Linear) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [linear(self.in_proj_qkv, hidden), linear(self.in_proj_b, hidden), linear(self.in_proj_a, hidden)]
        z = linear(self.in_proj_z, hidden)
        return torch.cat(parts, dim=-1), z.reshape(*hidden.shape[:-1], self.v_heads, self.v_dim)
