"""The causal LM of every family (DistributedBloomForCausalLM, DistributedLlamaForCausalLM): a
transformers causal LM whose transformer blocks run in the swarm.

generate() works as for a local model: the cache it is given is a RemoteCache over a server-side
inference session. With trained prompts (tuning_mode), a session holds them before the text: it is
opened that much longer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from transformers.generation import GenerationMode
from transformers.modeling_outputs import CausalLMOutputWithPast

from .base import DistributedModelMixin, refuse_media
from .inference_session import InferenceSession
from .remote_cache import RemoteCache

__all__ = ["DistributedCausalLMMixin", "draft_overshoot"]


def draft_overshoot(prompt_lookup_num_tokens: int | None) -> int:
    """Tokens past max_length that speculative decoding may send in a verify pass (a session must
    have room for them): a draft model's candidates stop at max_length, plus the verified token;
    prompt lookup's may run k past it."""
    return 1 + (prompt_lookup_num_tokens or 0)


class DistributedCausalLMMixin(DistributedModelMixin):
    """A causal LM whose blocks are served by the swarm. Use as a context manager, or call shutdown().

    A family's class is this mixin, its family's transformers PreTrainedModel and GenerationMixin
    (peer/client/families.py makes it): the remote base model and an LM head.

    It keeps transformers' generate() rather than a loop of its own, so every decoding strategy
    (sampling, beams, assisted and speculative decoding, logits processors, stopping criteria)
    works as on a local model and is tested against it token for token. What it adds is where the
    cache lives: a session on the servers, opened per generate() (or kept across calls with
    inference_session()) and always closed, freeing the servers' memory, when the call returns.
    """

    def __init__(self, config, tuning_mode: str | None = None, pre_seq_len: int = 0):
        super().__init__(config, tuning_mode, pre_seq_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_to_embeddings()

    def tie_to_embeddings(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.remote.get_input_embeddings().weight

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    @property
    def active_session(self) -> InferenceSession | None:
        """The session of this thread's running generate() or inference_session() (None outside them)."""
        return self.remote.calls.active_session

    @contextlib.contextmanager
    def inference_session(self, max_length: int) -> Iterator[InferenceSession]:
        """Keep one server-side session (and its caches) across several generate() or forward calls.

        Inside it, generate() continues from the tokens already processed (pass the whole text
        so far, as with a local cache), and model(input_ids) runs only the given new tokens. The
        session belongs to the calling thread: other threads using the model get their own.
        """
        calls = self.remote.calls
        if calls.kept_session is not None:
            raise RuntimeError("an inference session is already active in this thread")
        session = self.client.open_session(max_length + self.remote.pre_seq_len)
        calls.kept_session = session
        try:
            yield session
        finally:
            calls.kept_session = None
            self.client.close_session(session)

    def forward(self, input_ids=None, cache=None, attention_mask=None, inputs_embeds=None, labels=None,
                use_cache=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        refuse_media(kwargs)
        outputs = self.remote(input_ids, cache=cache, attention_mask=attention_mask,
                                   inputs_embeds=inputs_embeds, output_attentions=output_attentions,
                                   output_hidden_states=output_hidden_states)
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length) -> None:
        if model_kwargs.get("cache") is not None or generation_config.use_cache is False:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        calls, prompts = self.remote.calls, self.remote.pre_seq_len
        session = calls.kept_session
        if session is None:
            length = max_cache_length + prompts
            if generation_mode is GenerationMode.ASSISTED_GENERATION:
                length += draft_overshoot(generation_config.prompt_lookup_num_tokens)
            session = calls.generate_session = self.client.open_session(length)
        model_kwargs["cache"] = RemoteCache(session, prompts)

    def generate(self, *args, **kwargs):
        """transformers' generate; without an inference_session(), on a session of its own, closed on return.
        Images are refused before any session opens (refuse_media)."""
        refuse_media(kwargs)
        calls = self.remote.calls
        outer, calls.generate_session = calls.generate_session, None
        try:
            return super().generate(*args, **kwargs)
        finally:
            session, calls.generate_session = calls.generate_session, outer
            if session is not None:
                self.client.close_session(session)
