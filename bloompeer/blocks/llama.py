"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, and the mixtures of experts built on them:
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss): its blocks as a checkpoint names them (`model.layers.{i}.*`),
and how a span of them computes.

One block as transformers' LlamaDecoderLayer computes it, in the same ops and order: RMSNorm,
rotary embeddings (rope.py) from each session's own positions, grouped-query attention with
`num_key_value_heads` heads of `head_dim`, and the SwiGLU MLP. A block is its two parts, attention
(`LlamaSpan.attention`) and MLP (the block's `mlp` module, made by `LlamaSpan.make_mlp`), each around
its norm and residual, so that a variant replaces only the part it changes. A variant is stated as its
few differences from Llama (`Variant`): Qwen2's q/k/v biases, Qwen3's q/k RMSNorm, the sliding windows
of Mistral and of Qwen2/Qwen3's later layers (masked by cache index; the cache keeps every token).
A mixture of experts is its dense base with sparse MLPs (moe.py): Mixtral is Mistral with experts,
Qwen3-MoE Qwen3 with experts (and dense layers among them), Qwen2-MoE Qwen2 with experts and a shared
expert, gpt-oss Llama with biases, attention sinks, alternating windows and its own experts.
DeepSeek-V3 is Llama with multi-head latent attention (mla.py, which caches a latent, not keys and
values) and DeepSeek's experts (a group-limited sigmoid router, shared experts, dense first layers);
GLM-4.5 is those experts on Llama's attention with partial rotary, biases and optional q/k norms.
The hybrids (Qwen3-Next, Qwen3.5) state their variants in qwen3_next.py, from two differences named
here: a gated query (q_proj's per-head query and gate, the output times sigmoid(gate)) and the
zero-centred (1 + w) RMSNorm.

Attention (attention.py) is PyTorch's scaled_dot_product_attention with an explicit mask (a session's
padding, causality and window), or gpt-oss's with sinks; neither copies the keys and values.

The client keeps the token embeddings, the final norm and the LM head (tied to the embeddings or
not, as `tie_word_embeddings` says).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention_with_sinks, grouped_attention
from .attention_inputs import AttentionInputs, PassAttention
from .family import ClientParts, ModelFamily
from .kv_cache import CacheLayout
from .mla import LatentAttention, check_latent_config, latent_layout
from .moe import (
    GptOssExpert, GroupLimitedRouter, MixtralExpert, Router, SparseMoe, softmax_then_top_k, split_fused_experts,
    top_k_then_softmax,
)
from .rms_norm import RMSNorm, ZeroCentredRMSNorm
from .rope import rope_frequencies, rotate_half
from .span import BlockSpan, Linear, Segment

__all__ = ["LLAMA", "LlamaSpan", "RMSNorm", "SwiGLU", "Variant", "client_modules", "qwen_experts_mlp",
           "qwen_moe_experts", "qwen_moe_mlp", "variant_of"]


@dataclass(frozen=True)
class Variant:
    """How one member of the family differs from plain Llama (whose defaults these are not all:
    Llama's biases come from its config, see `variant_of`)."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before the rotation (Qwen3)
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window, or None for full attention
    sinks: bool = False  # a learned logit per head that each query's softmax spreads over too (gpt-oss)
    norm_weight_first: bool = False  # RMSNorm multiplies by its weight before casting back (gpt-oss: OLMo 2's)
    mlp_name: str = "mlp"  # the MLP's name in a checkpoint (Mixtral: block_sparse_moe)
    # (config, layer) -> its sparse MLP, or None for a dense layer (SwiGLU); None: every layer dense
    make_mlp: Callable[[object, int], nn.Module | None] | None = None
    # (config, layer) -> (experts, experts a token uses), (0, 0) for a dense layer; None: every layer dense
    experts: Callable[[object, int], tuple[int, int]] | None = None
    convert: Callable[[dict], dict] | None = None  # a block's tensors as stored -> as its modules name them
    partial_rotary: bool = False  # rotate only the first partial_rotary_factor of each head (GLM-4.5)
    # (config, layer) -> its attention part with a `compute` of its own and its cache layout (DeepSeek-V3's
    # latent attention); None: grouped-query attention caching keys and values
    make_attention: Callable[[object, int], nn.Module] | None = None
    cache_layout: Callable[[object], CacheLayout] | None = None
    zero_centred_norm: bool = False  # every RMSNorm's weight is an offset from 1, cast after it (Qwen3-Next)
    gated_query: bool = False  # q_proj gives each head a query and a gate; output * sigmoid(gate) (Qwen3-Next)


def _layer_windows(config) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: `layer_types` says which layers slide (by default those past max_window_layers); a
    config without them (Qwen3-MoE's) slides every layer if it has a window."""
    if getattr(config, "layer_types", None) is None:
        return (config.sliding_window,) * config.num_hidden_layers
    return tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)


def _every_layer_sparse(config, layer_idx: int) -> tuple[int, int]:
    """Mixtral, gpt-oss: every layer routes to num_experts_per_tok of num_local_experts."""
    return config.num_local_experts, config.num_experts_per_tok


def qwen_moe_experts(config, layer_idx: int) -> tuple[int, int]:
    """Qwen2/Qwen3-MoE: sparse where `decoder_sparse_step` says and not in `mlp_only_layers`, else dense."""
    if layer_idx in config.mlp_only_layers or not config.num_experts or (layer_idx + 1) % config.decoder_sparse_step:
        return 0, 0
    return config.num_experts, config.num_experts_per_tok


def _mixtral_mlp(config, layer_idx: int) -> nn.Module:
    experts = [MixtralExpert(config.hidden_size, config.intermediate_size) for _ in range(config.num_local_experts)]
    return SparseMoe("gate", Router(config.hidden_size, config.num_local_experts), experts,
                     config.num_experts_per_tok, softmax_then_top_k(renormalize=True, weights_dtype_of_logits=False))


def qwen_moe_mlp(config, layer_idx: int, shared: bool = False) -> nn.Module | None:
    """A sparse layer's MLP (Qwen2-MoE adds a shared expert); None for a dense layer."""
    if not qwen_moe_experts(config, layer_idx)[0]:
        return None
    return qwen_experts_mlp(config, shared, config.norm_topk_prob)


def qwen_experts_mlp(config, shared: bool, renormalize: bool) -> nn.Module:
    """Qwen's sparse MLP: a softmax router, experts of moe_intermediate_size, maybe a shared expert."""
    experts = [SwiGLU(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)]
    shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size) if shared else None
    return SparseMoe("gate", Router(config.hidden_size, config.num_experts), experts, config.num_experts_per_tok,
                     softmax_then_top_k(renormalize, weights_dtype_of_logits=True), shared_expert)


def _gpt_oss_mlp(config, layer_idx: int) -> nn.Module:
    experts = [GptOssExpert(config.hidden_size, config.intermediate_size, config.swiglu_alpha, config.swiglu_limit)
               for _ in range(config.num_local_experts)]
    return SparseMoe("router", Router(config.hidden_size, config.num_local_experts, bias=True), experts,
                     config.num_experts_per_tok, top_k_then_softmax)


def _deepseek_experts(config, layer_idx: int) -> tuple[int, int]:
    """DeepSeek-V3, GLM-4.5: dense below first_k_dense_replace, sparse from there on."""
    if layer_idx < config.first_k_dense_replace:
        return 0, 0
    return config.n_routed_experts, config.num_experts_per_tok


def _deepseek_mlp(config, layer_idx: int) -> nn.Module | None:
    """A sparse layer's MLP: the group-limited router, routed experts and shared experts (n_shared_experts
    of them as one MLP, as transformers builds it); None for a dense layer."""
    if not _deepseek_experts(config, layer_idx)[0]:
        return None
    hidden, width = config.hidden_size, config.moe_intermediate_size
    router = GroupLimitedRouter(hidden, config.n_routed_experts, config.n_group, config.topk_group,
                                config.norm_topk_prob, config.routed_scaling_factor)
    experts = [SwiGLU(hidden, width) for _ in range(config.n_routed_experts)]
    return SparseMoe("gate", router, experts, config.num_experts_per_tok, None,
                     SwiGLU(hidden, width * config.n_shared_experts), shared_name="shared_experts")


_VARIANTS = {
    "llama": lambda c: Variant(qkv_bias=c.attention_bias, o_bias=c.attention_bias, mlp_bias=c.mlp_bias,
                               windows=(None,) * c.num_hidden_layers),
    "mistral": lambda c: Variant(windows=(c.sliding_window,) * c.num_hidden_layers),
    "qwen2": lambda c: Variant(qkv_bias=True, windows=_layer_windows(c)),
    "qwen3": lambda c: Variant(qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=True,
                               windows=_layer_windows(c)),
}
_VARIANTS |= {  # the mixtures of experts, each as its dense base's differences
    "mixtral": lambda c: replace(_VARIANTS["mistral"](c), mlp_name="block_sparse_moe", make_mlp=_mixtral_mlp,
                                 experts=_every_layer_sparse),
    "qwen2_moe": lambda c: replace(_VARIANTS["qwen2"](c), qkv_bias=c.qkv_bias, experts=qwen_moe_experts,
                                   make_mlp=lambda config, i: qwen_moe_mlp(config, i, shared=True)),
    "qwen3_moe": lambda c: replace(_VARIANTS["qwen3"](c), make_mlp=qwen_moe_mlp, experts=qwen_moe_experts),
    "gpt_oss": lambda c: Variant(qkv_bias=c.attention_bias, o_bias=c.attention_bias, windows=_layer_windows(c),
                                 sinks=True, norm_weight_first=True, make_mlp=_gpt_oss_mlp,
                                 experts=_every_layer_sparse,
                                 convert=lambda state: split_fused_experts(state, "mlp.experts.")),
    "deepseek_v3": lambda c: Variant(windows=(None,) * c.num_hidden_layers, make_attention=LatentAttention,
                                     cache_layout=latent_layout, make_mlp=_deepseek_mlp, experts=_deepseek_experts),
    "glm4_moe": lambda c: Variant(qkv_bias=c.attention_bias, qk_norm=c.use_qk_norm,
                                  windows=(None,) * c.num_hidden_layers, partial_rotary=True, make_mlp=_deepseek_mlp, experts=_deepseek_experts),
}


def variant_of(config, model_type: str | None = None) -> Variant:
    """The variant of `config` (as the variant `model_type` would read it, if given: a variant of another
    module states its differences from one of these)."""
    return _VARIANTS[model_type or config.model_type](config)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def norm_of(variant: Variant, size: int, eps: float) -> RMSNorm:
    """The variant's RMSNorm of `size` values."""
    if variant.zero_centred_norm:
        return ZeroCentredRMSNorm(size, eps)
    return RMSNorm(size, eps, variant.norm_weight_first)


class _Attention(nn.Module):
    def __init__(self, config, variant: Variant, layer_idx: int):
        super().__init__()
        hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads,
                                             config.num_key_value_heads, head_dim_of(config))
        self.q_proj = nn.Linear(hidden, heads * head_dim * (2 if variant.gated_query else 1), bias=variant.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=variant.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=variant.qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=variant.o_bias)
        if variant.qk_norm:
            self.q_norm = norm_of(variant, head_dim, config.rms_norm_eps)
            self.k_norm = norm_of(variant, head_dim, config.rms_norm_eps)
        if variant.sinks:
            self.sinks = nn.Parameter(torch.empty(heads))
        self.layer_idx, self.window = layer_idx, variant.windows[layer_idx]


class SwiGLU(nn.Module):
    """The Llama family's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def compute(self, hidden: torch.Tensor, linear: Linear, rows: list[int] | None = None) -> torch.Tensor:
        """hidden [rows..., hidden] (normed) -> [rows..., hidden], every linear layer through `linear`
        (rows: each request's row count in the pass, which a dense MLP needs not know)."""
        return linear(self.down_proj, F.silu(linear(self.gate_proj, hidden)) * linear(self.up_proj, hidden))


class LlamaBlock(nn.Module):
    """The parameters of block `layer_idx`, named as in a checkpoint (the MLP under the variant's
    mlp_name); LlamaSpan computes with them."""

    def __init__(self, config, variant: Variant, layer_idx: int, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = norm_of(variant, config.hidden_size, config.rms_norm_eps)
        self.self_attn = variant.make_attention(config, layer_idx) if variant.make_attention \
            else _Attention(config, variant, layer_idx)
        self.post_attention_layernorm = norm_of(variant, config.hidden_size, config.rms_norm_eps)
        self.add_module(variant.mlp_name, mlp)
        self.mlp_name = variant.mlp_name

    @property
    def feed_forward(self) -> nn.Module:
        """The MLP, under whichever name its checkpoint gives it."""
        return self._modules[self.mlp_name]


class LlamaSpan(BlockSpan):
    """Blocks [start, end) of a Llama-family model."""

    @classmethod
    def variant_for(cls, config) -> Variant:
        """How the model of `config` differs from plain Llama (a span of another module names its own)."""
        return variant_of(config)

    @classmethod
    def check_config(cls, config) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not served (the Llama family's is silu)")
        variant = cls.variant_for(config)
        rope_frequencies(config, head_dim_of(config), variant.partial_rotary)  # raises for a rope type not served
        if config.num_attention_heads % config.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if variant.make_attention is LatentAttention:
            check_latent_config(config)
        if variant.make_mlp is _deepseek_mlp and config.n_routed_experts % config.n_group:
            raise ValueError("n_routed_experts must be a multiple of n_group")

    def __init__(self, config, start: int, end: int):
        self.variant = self.variant_for(config)
        super().__init__(config, start, end)
        self.rope = rope_frequencies(config, self.head_dim, self.variant.partial_rotary)
        self.scale = self.head_dim ** -0.5
        self._windows = {self.variant.windows[i] for i in range(start, end)}

    def make_block(self, config, layer_idx: int) -> nn.Module:
        return LlamaBlock(config, self.variant, layer_idx, self.make_mlp(config, layer_idx))

    def make_mlp(self, config, layer_idx: int) -> nn.Module:
        """Block `layer_idx`'s MLP: a module with the checkpoint's names and a `compute(hidden, linear, rows)`
        (a mixture of experts' variant makes its sparse layers)."""
        sparse = self.variant.make_mlp(config, layer_idx) if self.variant.make_mlp is not None else None
        return sparse if sparse is not None else SwiGLU(config.hidden_size, config.intermediate_size,
                                                        self.variant.mlp_bias)

    @classmethod
    def experts_of(cls, config) -> tuple[tuple[int, int], ...]:
        experts = cls.variant_for(config).experts
        return tuple(experts(config, i) if experts else (0, 0) for i in range(config.num_hidden_layers))

    def static_step_refusal(self, start: int, end: int, rows: int) -> str | None:
        if self.rope.rope_type == "dynamic":
            return "dynamic rope rescales its frequencies by the longest position so far, read on the host"
        return super().static_step_refusal(start, end, rows)

    def block_state(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        convert = self.variant.convert
        return tensors if convert is None else convert(tensors)

    @classmethod
    def cache_layout(cls, config, layer_idx: int) -> CacheLayout:
        layout = cls.variant_for(config).cache_layout
        if layout is not None:
            return layout(config)
        return CacheLayout.keys_and_values(config.num_key_value_heads, head_dim_of(config))

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    def attention_inputs(self, segment: Segment) -> AttentionInputs:
        return AttentionInputs(segment, self.rope, self._windows)

    def pass_attention(self, segments: Sequence[Segment]) -> PassAttention:
        return PassAttention(super().pass_attention(segments))

    def block_forward(self, block: LlamaBlock, hidden: torch.Tensor, attention: PassAttention,
                      rows: list[int], linear: Linear) -> torch.Tensor:
        """LlamaDecoderLayer.forward: attention, then the MLP, each on its normed input and added back."""
        normed, attn = block.input_layernorm(hidden), block.self_attn
        if hasattr(attn, "compute"):  # an attention part of the variant's own (latent attention)
            hidden = hidden + attn.compute(normed, attention, rows, linear, self.per_segment)
        else:
            hidden = hidden + self.attention(attn, normed, attention, rows, linear)
        return hidden + block.feed_forward.compute(block.post_attention_layernorm(hidden), linear, rows)

    def attention(self, attn: _Attention, normed: torch.Tensor, attention: PassAttention, rows: list[int],
                  linear: Linear) -> torch.Tensor:
        """The attention part's output (before the residual): q/k norms and rotation on every row at once,
        attention segment by segment."""
        query, gate = linear(attn.q_proj, normed), None
        if self.variant.gated_query:  # Qwen3-Next: each head's query, then its gate
            query, gate = query.view(*query.shape[:-1], -1, 2 * self.head_dim).chunk(2, dim=-1)
            query, gate = query.flatten(-2), gate.flatten(-2)
        query, key = self._rotated(attn, query, linear(attn.k_proj, normed), attention)
        qkv = query, key, linear(attn.v_proj, normed)
        context = self.per_segment(qkv, attention, rows, lambda q, k, v, inputs: self._attend(attn, q, k, v, inputs))
        if gate is not None:
            context = context * torch.sigmoid(gate)
        return linear(attn.o_proj, context)

    def _rotated(self, attn: _Attention, query: torch.Tensor, key: torch.Tensor,
                 attention: PassAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k [..., heads * head_dim] -> [..., heads, head_dim], normed (Qwen3) and rotated. Elementwise, so
        the same values as transformers', which rotates after moving heads before tokens."""
        query = query.view(*query.shape[:-1], -1, self.head_dim)
        key = key.view(*key.shape[:-1], -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            query, key = attn.q_norm(query), attn.k_norm(key)
        cos, sin = attention.cos, attention.sin
        dim = self.rope.dim
        if dim < self.head_dim:  # partial rotary (GLM-4.5): the rest of each head passes unrotated
            return tuple(torch.cat([x[..., :dim] * cos + rotate_half(x[..., :dim]) * sin, x[..., dim:]], dim=-1)
                         for x in (query, key))
        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin

    def _attend(self, attn: _Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                inputs: AttentionInputs) -> torch.Tensor:
        """One segment's attention: q/k [batch (* num_new), ..., heads, head_dim] (rotated), v [batch (* num_new),
        ..., heads * head_dim] -> [batch, num_new, hidden]."""
        shape = (inputs.batch, inputs.num_new, -1, self.head_dim)
        query, key, value = (part.view(shape).transpose(1, 2) for part in (query, key, value))  # [batch, heads, new, dim]
        if inputs.cache is not None:
            key, value = inputs.cache.update(attn.layer_idx, key, value)  # [batch, kv heads, kv_length, head_dim]
        if self.variant.sinks:
            context = attention_with_sinks(query, key, value, inputs.key_bias[attn.window], self.scale, attn.sinks)
        else:
            context = grouped_attention(query, key, value, inputs.key_bias[attn.window], self.scale)
        return context.transpose(1, 2).reshape(inputs.batch, inputs.num_new, -1)


def client_modules(span_class: type[LlamaSpan]) -> Callable[[object], dict[str, nn.Module]]:
    """config -> LlamaModel's modules around its blocks, for a model of span_class (every variant's alike but
    for the norm's arithmetic)."""
    def make(config) -> dict[str, nn.Module]:
        norm = norm_of(span_class.variant_for(config), config.hidden_size, config.rms_norm_eps)
        return {"embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id),
                "norm": norm}
    return make


LLAMA = ModelFamily(
    name="llama",
    config_classes={"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                    "qwen3": "Qwen3Config", "mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig",
                    "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig", "deepseek_v3": "DeepseekV3Config",
                    "glm4_moe": "Glm4MoeConfig"},
    span_class=LlamaSpan,
    block_prefix_format="model.layers.{}.",
    stored_prefix="",
    client=ClientParts(class_name="Llama", pretrained_model="LlamaPreTrainedModel", tensor_prefix="model.",
                       embeddings="embed_tokens", embedding_norm=None, final_norm="norm", make_modules=client_modules(LlamaSpan)),
)
