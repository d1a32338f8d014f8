"""transformers' own model with deep prompts added before each block, as servers add them: the reference
that prompt tuning through the swarm is compared with, for every family."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["assert_prompt_gradients_equal", "deep_prompts_in", "reference_prompt_gradients"]


@contextlib.contextmanager
def deep_prompts_in(blocks: nn.ModuleList, per_block: torch.Tensor) -> Iterator[None]:
    """While inside: block i adds per_block[i] ([batch or 1, k, hidden]) to its first k input positions
    (forward pre-hooks, whether the block takes its hidden states by position or by keyword)."""

    def adding(block_prompts):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            length = block_prompts.shape[-2]
            hidden = torch.cat([hidden[:, :length] + block_prompts, hidden[:, length:]], dim=1)
            if "hidden_states" in kwargs:
                return args, kwargs | {"hidden_states": hidden}
            return (hidden, *args[1:]), kwargs
        return hook

    hooks = [block.register_forward_pre_hook(adding(per_block[i]), with_kwargs=True) for i, block in enumerate(blocks)]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def reference_prompt_gradients(reference, blocks: nn.ModuleList, embeds: torch.Tensor, ids: torch.Tensor,
                               prompts: torch.Tensor, deep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of the LM loss on `ids` with respect to copies of `prompts` ([k, hidden]) and `deep`
    ([k, blocks * hidden], a deep_ptune model's weights), the input embeddings `embeds` given."""
    prompts, deep = prompts.detach().clone().requires_grad_(), deep.detach().clone().requires_grad_()
    length = prompts.shape[0]
    with deep_prompts_in(blocks, deep.view(length, len(blocks), -1).permute(1, 0, 2)):
        full = torch.cat([prompts.expand(ids.shape[0], -1, -1), embeds], dim=1)
        logits = reference(inputs_embeds=full).logits[:, length:].contiguous()
        reference.loss_function(logits, ids, vocab_size=reference.config.vocab_size).backward()
    return prompts.grad, deep.grad


def assert_prompt_gradients_equal(ours, reference, bound: float = 2e-6) -> None:
    """Seeds a deep_ptune Llama-family model's prompts (deep ones not zero, so every block's prompts
    matter), backpropagates its LM loss through the swarm, and compares both prompts' gradients with
    transformers' `reference` on the same text.

    Not bitwise: the servers' autograd accumulates in other orders than transformers' (3.7-4.4e-7 of
    the largest gradient apart for dense blocks, 2.9-5.7e-7 for Qwen3-MoE over 8 seeds), while an
    element near zero can be a few percent off its own value; so the bound is relative to the
    gradient's scale: `bound` of its largest element, 2e-6 but where a family says why not."""
    prompts, deep = ours.model.prompt_embeddings.weight, ours.model.intermediate_prompt_embeddings.weight
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        prompts.normal_(generator=generator)
        deep.normal_(std=0.3, generator=generator)
    ids = torch.randint(10, 250, (2, 6), generator=generator)
    ours(ids, labels=ids).loss.backward()
    expected = reference_prompt_gradients(reference, reference.model.layers, reference.model.embed_tokens(ids), ids,
                                          prompts, deep)
    for mine, theirs in zip((prompts.grad, deep.grad), expected):
        scale = float(theirs.abs().max())
        assert scale > 0
        torch.testing.assert_close(mine, theirs, rtol=0, atol=bound * scale)
