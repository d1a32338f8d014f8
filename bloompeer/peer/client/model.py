"""DistributedBloomForCausalLM: a transformers model whose transformer blocks run in the swarm.

The client holds the word embeddings, their layernorm, the final layernorm and the LM head
(tied to the embeddings); everything between goes through servers. generate() works as for a
local model: the cache it is given is a RemoteCache over a server-side inference session.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from transformers import BloomConfig, GenerationConfig
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, CausalLMOutputWithCrossAttentions
from transformers.models.bloom.modeling_bloom import BloomPreTrainedModel

from ...blocks import CLIENT_TENSOR_PREFIXES, open_checkpoint
from ...p2p import NetworkConfig
from .config import ClientConfig
from .inference_session import InferenceSession
from .remote_cache import RemoteCache
from .swarm_client import SwarmClient

__all__ = ["DistributedBloomModel", "DistributedBloomForCausalLM"]


def _wire_padding_mask(attention_mask: torch.Tensor | None, num_new: int) -> torch.Tensor | None:
    """The new tokens' padding mask as servers take it: bool, or None when nothing is padding."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -num_new:].bool()
    return None if bool(mask.all()) else mask


class DistributedBloomModel(BloomPreTrainedModel):
    """BloomModel with remote blocks: embeddings -> swarm -> final layernorm."""

    def __init__(self, config: BloomConfig, swarm: SwarmClient | None = None):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.swarm = swarm
        self.active_session: InferenceSession | None = None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.word_embeddings

    def set_input_embeddings(self, new_embeddings: nn.Embedding) -> None:
        self.word_embeddings = new_embeddings

    def forward(self, input_ids=None, cache=None, attention_mask=None, inputs_embeds=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, return_dict=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if output_attentions or output_hidden_states:
            raise ValueError("attentions and per-block hidden states stay on the servers")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        hidden = self.word_embeddings_layernorm(inputs_embeds)  # [batch, new, hidden]
        session = cache.session if isinstance(cache, RemoteCache) else self.active_session
        if cache is not None and not isinstance(cache, RemoteCache):
            raise ValueError("a distributed model keeps its cache on the servers: use generate() or "
                             "model.inference_session() instead of passing a cache")
        padding_mask = _wire_padding_mask(attention_mask, hidden.shape[1])
        if session is not None:
            hypo_ids = cache.take_hypo_ids() if isinstance(cache, RemoteCache) else None
            hidden = self.swarm.step(session, hidden, padding_mask, hypo_ids)
        else:
            hidden = self.swarm.forward(hidden, padding_mask)
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=self.ln_f(hidden), cache=cache)


class DistributedBloomForCausalLM(BloomPreTrainedModel, GenerationMixin):
    """A BLOOM causal LM whose blocks are served by the swarm. Use as a context manager, or call shutdown()."""

    def __init__(self, config: BloomConfig, swarm: SwarmClient | None = None):
        super().__init__(config)
        self.transformer = DistributedBloomModel(config, swarm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.word_embeddings.weight
        self._generate_session: InferenceSession | None = None

    @classmethod
    def from_pretrained(cls, name_or_path: str, *, initial_peers: tuple[str, ...] | list[str] = (),
                        dtype: torch.dtype = torch.float32, client_config: ClientConfig | None = None,
                        verify_fraction: float | None = None, trusted_servers: tuple[str, ...] | None = None,
                        revision: str | None = None, cache_dir: str | None = None) -> DistributedBloomForCausalLM:
        """Load the embeddings and layernorms of a checkpoint (directory or hub name) and join the swarm.

        Only the shards holding those tensors are read (or downloaded); the blocks stay remote.
        `initial_peers` are multiaddrs of peers in the swarm; `client_config` holds every network
        and timeout setting (initial_peers is then ignored). `verify_fraction`: the share of steps
        recomputed elsewhere to catch a lying server; `trusted_servers`: peer ids to use exclusively.
        """
        checkpoint = open_checkpoint(name_or_path, revision, cache_dir)
        config = checkpoint.config()
        tensors = checkpoint.load_tensors(CLIENT_TENSOR_PREFIXES, dtype, desc="embeddings and layernorms")
        if client_config is None:
            client_config = ClientConfig(network=NetworkConfig(initial_peers=tuple(initial_peers), client_mode=True))
        if verify_fraction is not None:
            client_config = dataclasses.replace(client_config, verify_fraction=verify_fraction)
        if trusted_servers is not None:
            client_config = dataclasses.replace(client_config, trusted_servers=tuple(trusted_servers))
        with torch.device("meta"):
            model = cls(config)
        state = {f"transformer.{name}": tensor for name, tensor in tensors.items() if not name.startswith("lm_head.")}
        model.load_state_dict(state, strict=False, assign=True)
        model.lm_head.weight = model.transformer.word_embeddings.weight
        missing = [name for name, tensor in model.state_dict().items() if tensor.is_meta]
        if missing:
            raise ValueError(f"{name_or_path} lacks the client tensors {missing}")
        if checkpoint.has_file("generation_config.json"):
            model.generation_config = GenerationConfig.from_pretrained(checkpoint.file("generation_config.json").parent)
        model.transformer.swarm = SwarmClient.connect(checkpoint, dtype, client_config)
        return model.eval()

    @property
    def swarm(self) -> SwarmClient:
        return self.transformer.swarm

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @contextlib.contextmanager
    def inference_session(self, max_length: int) -> Iterator[InferenceSession]:
        """Keep one server-side session (and its caches) across several generate() or forward calls.

        Inside it, generate() continues from the tokens already processed (pass the whole text
        so far, as with a local cache), and model(input_ids) runs only the given new tokens.
        """
        if self.transformer.active_session is not None:
            raise RuntimeError("an inference session is already active on this model")
        session = self.swarm.open_session(max_length)
        self.transformer.active_session = session
        try:
            yield session
        finally:
            self.transformer.active_session = None
            self.swarm.close_session(session)

    def forward(self, input_ids=None, cache=None, attention_mask=None, inputs_embeds=None, labels=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithCrossAttentions:
        outputs = self.transformer(input_ids, cache=cache, attention_mask=attention_mask,
                                   inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                                   output_hidden_states=output_hidden_states)
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits, cache=outputs.cache)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length) -> None:
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        session = self.transformer.active_session
        if session is None:
            session = self._generate_session = self.swarm.open_session(max_cache_length)
        model_kwargs["cache"] = RemoteCache(session)

    def generate(self, *args, **kwargs):
        try:
            return super().generate(*args, **kwargs)
        finally:
            if self._generate_session is not None:
                session, self._generate_session = self._generate_session, None
                self.swarm.close_session(session)

    def shutdown(self) -> None:
        """Leave the swarm: close the network peer and its event loop thread. Idempotent."""
        if self.swarm is not None:
            self.swarm.shutdown()

    def __enter__(self) -> DistributedBloomForCausalLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()
