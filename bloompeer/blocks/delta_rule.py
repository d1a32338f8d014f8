"""The gated delta rule: Gated DeltaNet's linear attention (Qwen3-Next, Qwen3.5), as transformers' own
torch implementation computes it (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`l2norm`, and the causal depthwise convolution before them), op for op, so that float32 results are its own.

Why two algorithms: a head's state is a [k_dim, v_dim] matrix that every token decays (by exp(g)) and
corrects toward its value (the delta rule, at rate beta). A prompt computes it 64 tokens at a time,
solving each chunk's updates as one triangular system (matrix products); a decode step applies the
rule to its one token. The two round differently, so `gated_delta_rule` chooses as transformers does:
the recurrent rule for one token after a state, the chunked algorithm for anything else.

Shapes: query/key [batch, tokens, k_heads, k_dim], value [batch, tokens, v_heads, v_dim], g/beta
[batch, tokens, v_heads], state [batch, v_heads, k_dim, v_dim] (always float32, as transformers keeps it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["CHUNK_SIZE", "causal_conv", "chunk_gated_delta_rule", "gated_delta_rule", "l2norm",
           "recurrent_gated_delta_rule"]

CHUNK_SIZE = 64  # transformers' (and the fla kernels') chunk of the prompt algorithm


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps), written as transformers (and the fla library) write it."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def causal_conv(inputs: torch.Tensor, window: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution, then silu: inputs [batch, channels, tokens] after the `window`
    [batch, channels, kernel - 1] of the inputs before them (None: a fresh session's), weight
    [channels, 1, kernel] -> [batch, channels, tokens].

    Each output is the same kernel-long dot product however it is written, but PyTorch's convolution
    rounds differently with the input's length and layout, so this writes it as transformers does
    with a cache (causal_conv1d_fn and causal_conv1d_update as causal_conv1d_forward calls them): a fresh
    prompt padded inside the convolution (by hand first if shorter than the kernel), a step or a
    continuation after transformers' conv state, which is `kernel` inputs long (its first input never
    reaches a kept output, so a zero stands in for it: the session keeps only kernel - 1); and silu
    on the very slice transformers gives it, whose layout decides which elements its vector code takes.""" 
    kernel, length = weight.shape[-1], inputs.shape[-1]
    if window is None:
        joined = inputs if length >= kernel else F.pad(inputs, (kernel - length, 0))
    else:
        joined = torch.cat([window.new_zeros(*window.shape[:-1], 1), window, inputs], dim=-1)
    joined = joined.to(weight.dtype)
    if window is not None and length == 1:  # silu on the one output, or on all before the slice: as it does
        return F.silu(F.conv1d(joined, weight, None, padding=0, groups=joined.shape[1])[..., -1:]).to(inputs.dtype)
    output = F.conv1d(joined, weight, None, padding=kernel - 1, groups=joined.shape[1])[..., :joined.shape[-1]]
    return F.silu(output)[..., -length:].to(inputs.dtype)


def _prepared(query, key, value, g, beta):
    """transformers' common start: key heads repeated for their value heads, everything float32 with heads
    before tokens, q and k l2-normed, queries scaled by k_dim ** -0.5."""
    k_heads, v_heads = key.shape[2], value.shape[2]
    if k_heads != v_heads:
        query = query.repeat_interleave(v_heads // k_heads, dim=2)
        key = key.repeat_interleave(v_heads // k_heads, dim=2)
    query, key, value, beta, g = [x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, beta, g)]
    return l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6), value, g, beta


def chunk_gated_delta_rule(query, key, value, g, beta, initial_state: torch.Tensor | None = None,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt algorithm: (output [batch, tokens, v_heads, v_dim] in the query's dtype, final state)."""
    initial_dtype = query.dtype
    batch, length, _, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    query, key, value, decay, beta = _prepared(query, key, value, g, beta)
    query = query * query.shape[-1] ** -0.5

    pad_size = (chunk_size - length % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    num_chunks = (length + pad_size) // chunk_size
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [x.reshape(x.shape[0], x.shape[1], -1, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]  # [batch, heads, chunk, position, dim]
    decay = decay.reshape(decay.shape[0], decay.shape[1], -1, chunk_size)
    strictly_upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)  # log of the decay from the chunk's start to each position

    # within a chunk: pairwise decays, the triangular system of the chunk's updates, its causal attention
    pairwise_decay = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(strictly_upper, float("-inf"))
    pairwise_decay = pairwise_decay.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)

    if initial_state is None:
        state = torch.zeros((batch, v_heads, k_dim, v_dim), dtype=new_values.dtype, device=new_values.device)
    else:
        state = initial_state.to(new_values)
    output = torch.zeros_like(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]
    for i in range(num_chunks):  # across chunks: each reads the state the chunks before it left
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        output[:, :, i] = query[:, :, i] @ state + intra_chunk_attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new

    output = output.reshape(batch, v_heads, -1, v_dim)[:, :, :length]
    return output.transpose(1, 2).to(initial_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step algorithm, token by token: (output [batch, tokens, v_heads, v_dim], final state)."""
    initial_dtype = query.dtype
    batch, length, _, k_dim = key.shape
    v_heads, v_dim = value.shape[-2:]
    query, key, value, decay, beta = _prepared(query, key, value, g, beta)
    query = query / (query.shape[-1] ** 0.5)
    if initial_state is None:
        state = torch.zeros((batch, v_heads, k_dim, v_dim), dtype=value.dtype, device=value.device)
    else:
        state = initial_state.to(value)
    output = torch.zeros_like(value)
    for i in range(length):
        q_t, k_t, v_t = query[:, :, i], key[:, :, i], value[:, :, i]
        state = state * decay[:, :, i].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)  # what the state predicts for this key
        delta = (v_t - kv_mem) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        output[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return output.transpose(1, 2).contiguous().to(initial_dtype), state


def gated_delta_rule(query, key, value, g, beta, initial_state: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' choice: the recurrent rule for one token after a state, the chunked one otherwise."""
    if initial_state is not None and query.shape[1] == 1:
        return recurrent_gated_delta_rule(query, key, value, g, beta, initial_state)
    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state)
