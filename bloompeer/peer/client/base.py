"""What every distributed model class shares, whatever its family: the client's part of the model,
loading it from a checkpoint, joining the swarm, and the trainable prompts of prompt tuning.

The client holds the embeddings, the final norm and the LM head (the tensors its family says a
client keeps); every block in between runs on servers. With tuning_mode="ptune", `pre_seq_len`
trainable prompt embeddings are put before the input; with "deep_ptune", trainable prompts are also
added to those positions before every block (the servers add them; their weights stay frozen).
"""

from __future__ import annotations

import dataclasses
import threading

import torch
from torch import nn
from transformers import GenerationConfig
from transformers.modeling_outputs import BaseModelOutputWithPast

from ...blocks import Checkpoint, ClientParts, open_checkpoint
from ...p2p import NetworkConfig, RequestError
from .config import ClientConfig
from .inference_session import InferenceSession
from .remote_cache import RemoteCache
from .swarm_client import SwarmClient

__all__ = ["CallsInThisThread", "DistributedModelMixin", "RemoteBlocksModel", "TUNING_MODES", "refuse_media"]

TUNING_MODES = (None, "ptune", "deep_ptune")
# Keyword arguments that carry images, video or sound to a multimodal model (transformers' names: pixel_values,
# image_grid_thw, pixel_values_videos, video_grid_thw, mm_encoder_outputs (Kimi K2.5), input_features, ...)
_MEDIA_ARGUMENTS = ("pixel_values", "image", "video", "audio", "mm_", "input_features")


def refuse_media(kwargs: dict) -> None:
    """RequestError for images (or video, sound) passed to a model call: bloompeer serves text models, and of a
    multimodal checkpoint (Kimi K2.5's, Qwen3.5's) its text model only, so they would be silently ignored."""
    media = sorted(name for name, value in kwargs.items()
                   if value is not None and any(part in name for part in _MEDIA_ARGUMENTS))
    if media:
        raise RequestError(f"{', '.join(media)}: images, video and sound are not taken: bloompeer serves text "
                           "models (of a multimodal checkpoint such as Kimi K2.5 or Qwen3.5, its text model only); "
                           "pass the text alone (input_ids)")


def _wire_padding_mask(attention_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
    """The new tokens' padding mask as servers take it: bool, or None when nothing is padding."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -num_new:].bool()
    return None if bool(mask.all()) else mask


class CallsInThisThread(threading.local):
    """The sessions of the calls running in the current thread.

    One model object serves many threads at once (an HTTP server calls it from every request), so
    what a call opens never lives on the model itself: each thread sees only its own sessions, and
    one call can neither use nor close another's.
    """

    def __init__(self):
        self.kept_session: InferenceSession | None = None  # from model.inference_session(), across calls
        self.generate_session: InferenceSession | None = None  # opened by the running generate(), closed by it

    @property
    def active_session(self) -> InferenceSession | None:
        return self.kept_session or self.generate_session


class RemoteBlocksModel:
    """The base model of every family with its blocks in the swarm: embeddings (+ prompts) -> swarm ->
    final norm. A mixin of the family's transformers PreTrainedModel (DistributedBloomModel,
    DistributedLlamaModel: peer/client/families.py makes them), which holds the family's local modules,
    named and used as `parts` says; everything else is the same for every family.

    It is a transformers model so that everything built on one (generate, heads, PEFT-style prompt
    tuning, the Trainer) works unchanged; only the blocks are swapped for the swarm. With a session
    (generate's cache, or model.inference_session()) a forward is one decode step of that session;
    without one it is a full, differentiable forward that keeps nothing on the servers.
    """

    parts: ClientParts  # the family's (blocks/family.py)

    def __init__(self, config, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        for name, module in self.parts.make_modules(config).items():
            setattr(self, name, module)
        self._init_remote(config, tuning_mode, pre_seq_len)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return getattr(self, self.parts.embeddings)

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        setattr(self, self.parts.embeddings, new_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.get_input_embeddings()(input_ids)

    def to_swarm(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """What the first block takes, from the embeddings (BLOOM: their layernorm)."""
        norm = self.parts.embedding_norm
        return inputs_embeds if norm is None else getattr(self, norm)(inputs_embeds)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.parts.final_norm)(hidden)

    def _init_remote(self, config, tuning_mode: str | None, pre_seq_len: int) -> None:
        """The prompts of prompt tuning, and no swarm connection yet (from_pretrained makes it)."""
        if tuning_mode not in TUNING_MODES or (tuning_mode is not None and pre_seq_len < 1):
            raise ValueError(f"tuning_mode must be one of {TUNING_MODES}, with pre_seq_len >= 1 for prompt tuning")
        self.tuning_mode, self.pre_seq_len = tuning_mode, pre_seq_len if tuning_mode else 0
        if tuning_mode:
            self.prompt_embeddings = nn.Embedding(pre_seq_len, config.hidden_size)
        if tuning_mode == "deep_ptune":
            self.intermediate_prompt_embeddings = nn.Embedding(pre_seq_len,
                                                               config.num_hidden_layers * config.hidden_size)
        self.client: SwarmClient | None = None  # set by from_pretrained: the connection to the swarm
        self.calls = CallsInThisThread()

    def init_prompts(self) -> None:
        """Input prompts like word embeddings; deep prompts at zero (so they start as plain ptune)."""
        if self.tuning_mode:
            nn.init.normal_(self.prompt_embeddings.weight, std=self.config.initializer_range)
        if self.tuning_mode == "deep_ptune":
            nn.init.zeros_(self.intermediate_prompt_embeddings.weight)

    def _with_prompts(self, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None):
        """Prepend the input prompts; the deep prompts as servers take them ([blocks, batch, k, hidden])."""
        if not self.tuning_mode:
            return inputs_embeds, attention_mask, None
        batch, k = inputs_embeds.shape[0], self.pre_seq_len
        prompts = self.prompt_embeddings.weight.to(inputs_embeds.dtype).expand(batch, -1, -1)
        inputs_embeds = torch.cat([prompts, inputs_embeds], dim=1)
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask.new_ones(batch, k), attention_mask], dim=1)
        deep = None
        if self.tuning_mode == "deep_ptune":
            weight = self.intermediate_prompt_embeddings.weight.to(inputs_embeds.dtype)
            deep = weight.view(k, self.config.num_hidden_layers, -1).permute(1, 0, 2)[:, None].expand(-1, batch, -1, -1)
        return inputs_embeds, attention_mask, deep

    def forward(self, input_ids=None, cache=None, attention_mask=None, inputs_embeds=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        """Hidden states after the last block and the final norm (prompt positions removed).

        Positions are the servers' business: each token's is the count of real (unpadded) tokens
        before it, as transformers' generate counts them (position_ids are not taken)."""
        refuse_media(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if output_attentions or output_hidden_states:
            raise ValueError("attentions and per-block hidden states stay on the servers")
        if cache is not None and not isinstance(cache, RemoteCache):
            raise ValueError("a distributed model keeps its cache on the servers: use generate() or "
                             "model.inference_session() instead of passing a cache")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        session = cache.session if isinstance(cache, RemoteCache) else self.calls.kept_session
        if session is not None:
            hidden = self._step(session, cache, inputs_embeds, attention_mask)
        else:
            inputs_embeds, attention_mask, deep_prompts = self._with_prompts(inputs_embeds, attention_mask)
            hidden = self.to_swarm(inputs_embeds)
            hidden = self.client.forward(hidden, _wire_padding_mask(attention_mask, hidden.shape[1]), deep_prompts)
            hidden = hidden[:, self.pre_seq_len:]
        return BaseModelOutputWithPast(last_hidden_state=self.final_norm(hidden), cache=cache)

    def _step(self, session: InferenceSession, cache: RemoteCache | None, inputs_embeds: torch.Tensor,
              attention_mask: torch.Tensor | None) -> torch.Tensor:
        """One inference step; a session's first step starts with the prompts (input prompts, and
        deep prompts that the servers add there), which then stay in their caches before the text."""
        num_new, deep_prompts = inputs_embeds.shape[1], None
        if session.position == 0:
            inputs_embeds, attention_mask, deep_prompts = self._with_prompts(inputs_embeds, attention_mask)
        hidden = self.to_swarm(inputs_embeds)  # [batch, new (+ prompts), hidden]
        hypo_ids = cache.take_hypo_ids() if cache is not None else None
        padding_mask = _wire_padding_mask(attention_mask, hidden.shape[1])
        hidden = self.client.runtime.run(session.step(hidden, padding_mask, hypo_ids, deep_prompts))
        return hidden[:, -num_new:]


class DistributedModelMixin:
    """from_pretrained, the swarm connection and its lifetime, for the distributed model classes.

    A mixin rather than a base class, because each model class must also be the matching
    transformers class (its family's PreTrainedModel with its own head) for generate and the
    Trainer to treat it as one. `remote` is the model's RemoteBlocksModel, under the attribute its
    family's transformers classes use (`transformer` for BLOOM, `model` for the Llama family).
    """

    base_model_class: type  # the family's RemoteBlocksModel (peer/client/families.py)

    def __init__(self, config, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config)
        setattr(self, self.base_model_prefix, self.base_model_class(config, tuning_mode, pre_seq_len))

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, initial_peers: tuple[str, ...] | list[str] = (),
                        dtype: torch.dtype = torch.float32, client_config: ClientConfig | None = None,
                        verify_fraction: float | None = None, trusted_servers: tuple[str, ...] | None = None,
                        tuning_mode: str | None = None, pre_seq_len: int = 0, revision: str | None = None,
                        cache_dir: str | None = None, **model_kwargs):
        """Load the client's tensors of a checkpoint (directory or hub name) and join the swarm.

        Only the shards holding the embeddings and layernorms are read (or downloaded); the blocks
        stay remote. `initial_peers` are multiaddrs of peers in the swarm; `client_config` holds
        every network and timeout setting (initial_peers is then ignored). `verify_fraction`: the
        share of steps recomputed elsewhere to catch a lying server; `trusted_servers`: peer ids to
        use exclusively. `tuning_mode` ("ptune" or "deep_ptune") with `pre_seq_len` adds trainable
        prompts. Other keyword arguments go to the class (e.g. num_labels for classification).
        """
        checkpoint = open_checkpoint(name_or_path, revision, cache_dir)
        config = checkpoint.config()
        for name, value in model_kwargs.items():
            setattr(config, name, value)
        if client_config is None:
            client_config = ClientConfig(network=NetworkConfig(initial_peers=tuple(initial_peers), client_mode=True))
        if verify_fraction is not None:
            client_config = dataclasses.replace(client_config, verify_fraction=verify_fraction)
        if trusted_servers is not None:
            client_config = dataclasses.replace(client_config, trusted_servers=tuple(trusted_servers))
        connecting = SwarmClient.start_connecting(checkpoint, client_config, dtype)  # while the tensors load
        try:
            model = cls._with_local_tensors(checkpoint, config, dtype, tuning_mode, pre_seq_len)
        except BaseException:
            connecting.cancel()
            raise
        model.remote.client = connecting.result()
        return model

    @classmethod
    def _with_local_tensors(cls, checkpoint: Checkpoint, config, dtype: torch.dtype, tuning_mode: str | None,
                            pre_seq_len: int):
        """The model with the checkpoint's embeddings, norms and head; prompts trainable, the rest frozen."""
        tensors = checkpoint.load_tensors(checkpoint.family.client_tensor_prefixes, dtype,
                                          desc="embeddings, norms and head")
        model = cls(config, tuning_mode=tuning_mode, pre_seq_len=pre_seq_len)  # its own tensors are initialised
        head_from_checkpoint = hasattr(model, "lm_head") and not config.tie_word_embeddings
        state = {model.state_name(name): tensor for name, tensor in tensors.items()
                 if head_from_checkpoint or not name.startswith("lm_head.")}
        loaded = model.load_state_dict(state, strict=False)
        if loaded.unexpected_keys:
            raise ValueError(f"{checkpoint.name_or_path} has tensors this model does not know: {loaded.unexpected_keys}")
        missing = [name for name in loaded.missing_keys
                   if not name.startswith(model.trained_locally) and (head_from_checkpoint or name != "lm_head.weight")]
        if missing:
            raise ValueError(f"{checkpoint.name_or_path} lacks the client's tensors {sorted(missing)}")
        model.remote.init_prompts()
        model.tie_to_embeddings()
        if checkpoint.has_file("generation_config.json"):
            model.generation_config = GenerationConfig.from_pretrained(checkpoint.file("generation_config.json").parent)
        model.requires_grad_(False)  # the model's own weights are not trained ...
        for trainable in model.trainable_modules():  # ... only prompts and heads
            trainable.requires_grad_(True)
        return model.to(dtype).eval()

    def tie_to_embeddings(self) -> None:
        """Share the LM head's weight with the input embeddings where the config says so (a causal LM's)."""

    @property
    def remote(self) -> RemoteBlocksModel:
        """The base model whose blocks run in the swarm."""
        return getattr(self, self.base_model_prefix)

    @property
    def trained_locally(self) -> tuple[str, ...]:
        """Names of parameters that no checkpoint holds: they are trained here (prompts, heads)."""
        prefix = self.base_model_prefix
        return f"{prefix}.prompt_embeddings.", f"{prefix}.intermediate_prompt_embeddings."

    def state_name(self, tensor_name: str) -> str:
        """This model's state-dict name of a checkpoint tensor (as its family names it)."""
        prefix = self.base_model_prefix + "."
        return tensor_name if tensor_name.startswith((prefix, "lm_head.")) else prefix + tensor_name

    def trainable_modules(self) -> list[nn.Module]:
        remote = self.remote
        return [getattr(remote, name) for name in ("prompt_embeddings", "intermediate_prompt_embeddings")
                if hasattr(remote, name)]

    @property
    def client(self) -> SwarmClient:
        """The connection to the swarm (network peer, event loop, swarm view) this model's blocks run on."""
        return self.remote.client

    def shutdown(self) -> None:
        """Leave the swarm: close the network peer and its event loop thread. Idempotent."""
        if self.client is not None:
            self.client.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
