"""The session state of recurrent (linear-attention) blocks, Gated DeltaNet's: the same size after 10
tokens as after 100k, and rolled back exactly.

What a block keeps of a session is not a row per token but, per value head, the delta rule's
[k_dim, v_dim] matrix (float32, as transformers keeps it) and the causal convolution's window, the
last `kernel - 1` inputs. Its bytes are a cost per session (`RecurrentLayout.nbytes`), not per token.

Rolling k tokens back (a speculative step's rejected drafts) cannot cut a matrix back, so a block
keeps two states and the inputs of its last pass: the state before that pass, and the one after it.
A step that follows the last pass reads the state after it; a step at an earlier position inside
the last pass first re-advances the state kept before the pass over the accepted tokens' kept inputs,
with the very computation a pass of just those tokens would have made (the layer's `mix`), so that
the state is bitwise what it would have been had the rejected tokens never been sent.

Why re-advance rather than keep each token's state (as transformers' assisted generation does),
measured on one block of Qwen3-Next's shapes, 8 drafts, float32 on this 2-core CPU
(benchmarks/recurrent_rollback.py, minimum of 12 interleaved rounds): keeping states holds 10 states
a block while the pass is in flight (20.9 MiB; 754 MiB a session over Qwen3-Next's 36 linear blocks)
where this holds 2 and the kept inputs (5.2 MiB; 187 MiB a session), and its pass took 18.6 ms where
this one takes 10.4 (nine 2 MiB states allocated anew and kept). Its rollback copies one state back
(0.2 ms) where this re-advances over the accepted tokens (2.4 ms for 1, 10.3 ms for 8), and only on a
step that follows a rejection.

Each block's two slots say which position they hold, so a pass that fails halfway leaves every block
able to start the same step again (a pass writes only into the slot it does not start from, and
marks it before writing). Sessions batch freely: each session's state is its own object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..errors import RequestError

__all__ = ["MAX_ROLLBACK_TOKENS", "FixedSlots", "LayerStart", "Mix", "RecurrentLayout", "RecurrentState", "RewindError"]

# Tokens of a pass whose inputs a block keeps for a rewind into it (a speculative step: the accepted
# token and its drafts): 32 covers transformers' default 20 drafts; at Qwen3-Next's shapes it is
# 0.5 MiB a block in bfloat16. A rollback into a pass longer than gated_deltanet.RECURRENT_PASS_TOKENS
# re-advances with the chunked algorithm, as a pass of the accepted tokens alone would run.
MAX_ROLLBACK_TOKENS = 32

LayerStart = tuple[torch.Tensor, torch.Tensor] | None  # (window [batch, channels, kernel - 1], state) or fresh
# (inputs [batch, tokens, input_width], start) -> (core output, (window, state) after those tokens)
Mix = Callable[[torch.Tensor, LayerStart], tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]]


class RewindError(RequestError):
    """A step at a position this session's recurrent state cannot be brought back to: the request can
    never succeed on this session as asked; its tokens must be replayed from position 0."""


@dataclass(frozen=True)
class RecurrentLayout:
    """What one recurrent block keeps of a session, whatever its length."""

    conv_dim: int  # the causal convolution's channels: queries, keys and values of every head
    conv_window: int  # inputs before a token that its convolution reads: linear_conv_kernel_dim - 1
    heads: int  # value heads, each with one state matrix
    key_dim: int
    value_dim: int

    @property
    def input_width(self) -> int:
        """What a token gives the rule (and a block keeps for a rewind): its convolution's inputs, b and a."""
        return self.conv_dim + 2 * self.heads

    def nbytes(self, batch: int, dtype: torch.dtype, max_rollback: int = MAX_ROLLBACK_TOKENS) -> int:
        """Two states (float32), two windows and the kept inputs (in `dtype`), for `batch` rows."""
        element_size = torch.empty((), dtype=dtype).element_size()
        states = 2 * self.heads * self.key_dim * self.value_dim * 4
        windows = 2 * self.conv_dim * self.conv_window * element_size
        return batch * (states + windows + max_rollback * self.input_width * element_size)


class _BlockState:
    """One block's two slots (each a window and a state, and the position it holds, None while invalid)
    and the inputs of its last pass (if it had at most max_rollback tokens)."""

    def __init__(self, layout: RecurrentLayout, batch: int, max_rollback: int, dtype: torch.dtype, device):
        self.states = torch.zeros(2, batch, layout.heads, layout.key_dim, layout.value_dim, dtype=torch.float32,
                                  device=device)
        self.windows = torch.zeros(2, batch, layout.conv_dim, layout.conv_window, dtype=dtype, device=device)
        self.inputs = torch.zeros(batch, max_rollback, layout.input_width, dtype=dtype, device=device)
        self.positions: list[int | None] = [None, None]
        self.inputs_at: int | None = None  # the position of the first kept input
        self.inputs_count = 0

    def slot_at(self, position: int) -> int | None:
        return self.positions.index(position) if position in self.positions else None

    def replay_from(self, position: int) -> int | None:
        """The position (0, or one a slot holds) from which the kept inputs lead to `position`, or None."""
        start = self.inputs_at
        if start is None or not start < position <= start + self.inputs_count:
            return None
        return start if start == 0 or self.slot_at(start) is not None else None

    def reachable(self, position: int) -> bool:
        return position == 0 or self.slot_at(position) is not None or self.replay_from(position) is not None

    def start(self, slot: int | None) -> LayerStart:
        return None if slot is None else (self.windows[slot], self.states[slot])

    def write(self, slot: int, position: int, window: torch.Tensor, state: torch.Tensor) -> None:
        self.positions[slot] = None  # invalid while half written
        self.store(slot, window, state)
        self.positions[slot] = position

    def store(self, slot: int, window: torch.Tensor, state: torch.Tensor) -> None:
        self.windows[slot].copy_(window)
        self.states[slot].copy_(state)

    def start_at(self, position: int, mix: Mix) -> tuple[int | None, int]:
        """(the slot holding the state at `position`, None if fresh; the slot the pass may write), first
        re-advancing the state kept before the last pass over its accepted inputs if need be."""
        if position == 0:  # a fresh start: what either slot holds belongs to an abandoned history
            self.positions[1] = None
            return None, 0
        slot = self.slot_at(position)
        if slot is None:
            source = self.replay_from(position)
            source_slot = None if source == 0 else self.slot_at(source)
            slot = 1 if source_slot == 0 else 0
            _, (window, state) = mix(self.inputs[:, : position - source], self.start(source_slot))
            self.write(slot, position, window, state)
        return slot, 1 - slot

    def keep_inputs(self, position: int, inputs: torch.Tensor) -> None:
        self.inputs_at = None
        if inputs.shape[1] <= self.inputs.shape[1]:
            self.inputs[:, : inputs.shape[1]].copy_(inputs)
            self.inputs_at, self.inputs_count = position, inputs.shape[1]

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        self.states.copy_(self.states[:, hypo_ids])
        self.windows.copy_(self.windows[:, hypo_ids])
        self.inputs.copy_(self.inputs[hypo_ids])


class RecurrentState:
    """The recurrent blocks' state of one session over a span: `layer_indices` are the span's recurrent
    blocks (by model layer). `begin_step` says where the next tokens go; each block then calls `run` once
    with its new tokens' inputs and its `mix`."""

    def __init__(self, layout: RecurrentLayout, layer_indices: Sequence[int], batch: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_rollback: int = MAX_ROLLBACK_TOKENS):
        self.layout, self.batch, self.max_rollback = layout, batch, max_rollback
        self._blocks = {index: _BlockState(layout, batch, max_rollback, dtype, device) for index in layer_indices}
        self.length = 0  # tokens seen so far
        self._position = 0

    @staticmethod
    def nbytes(layout: RecurrentLayout, num_layers: int, batch: int, dtype: torch.dtype,
               max_rollback: int = MAX_ROLLBACK_TOKENS) -> int:
        return num_layers * layout.nbytes(batch, dtype, max_rollback)

    def begin_step(self, position: int, num_new: int) -> None:
        """Place the next `num_new` tokens at `position`: the current length, an earlier position within
        the last pass (a rollback of what followed it), or 0 (a fresh start). RewindError for any other."""
        if not 0 <= position <= self.length:
            raise RewindError(f"cannot step at position {position}: the session has {self.length} tokens")
        if not all(block.reachable(position) for block in self._blocks.values()):
            raise RewindError(
                f"cannot rewind to position {position}: a recurrent state goes back only within its last step "
                f"of at most {self.max_rollback} tokens, or to 0; replay the session's tokens instead")
        self._position, self.length = position, position + num_new

    def run(self, layer_idx: int, inputs: torch.Tensor, mix: Mix) -> torch.Tensor:
        """Block `layer_idx`'s pass over the new tokens' inputs [batch, num_new, input_width], from its state
        at the step's position: mix's output, its state after them kept."""
        block, position = self._blocks[layer_idx], self._position
        start_slot, target = block.start_at(position, mix)
        output, (window, state) = mix(inputs, block.start(start_slot))
        block.write(target, position + inputs.shape[1], window, state)
        block.keep_inputs(position, inputs)
        return output

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Beam search: row i of the batch continues from row hypo_ids[i]."""
        for block in self._blocks.values():
            block.reorder(hypo_ids)

    # A static step (step_graphs.py) splits `run` in two: what it computes on the device, from slots fixed when
    # its graph was captured, and the slots' positions, which only the host keeps, marked before and after.

    def static_slots(self, start: int, end: int) -> tuple[int, ...] | None:
        """For a one-token step of blocks [start, end): each recurrent block's slot that holds the step's position
        (the step reads it and writes the other), or None where a block must first re-advance its state after a
        rollback, or starts afresh, which run eagerly."""
        if self._position == 0:
            return None
        slots = tuple(block.slot_at(self._position) for index, block in self._blocks.items() if start <= index < end)
        return None if None in slots else slots

    def fixed_slots(self, start: int, end: int, slots: tuple[int, ...]) -> FixedSlots:
        """The state as a static step of blocks [start, end) computes it, reading `slots` (static_slots)."""
        indices = [index for index in self._blocks if start <= index < end]
        return FixedSlots(self, dict(zip(indices, slots, strict=True)))


class FixedSlots:
    """A session's recurrent state as a static step sees it: each block reads the slot it was captured with and
    writes the other, on the device alone; `begin` and `end`, on the host, mark what that slot holds (invalid
    while the step runs, as `run` does, so that a failed step can be sent again)."""

    def __init__(self, state: RecurrentState, slots: dict[int, int]):
        self.state, self.slots = state, slots

    def begin(self) -> None:
        for index, slot in self.slots.items():
            block = self.state._blocks[index]
            block.positions[1 - slot], block.inputs_at = None, None

    def run(self, layer_idx: int, inputs: torch.Tensor, mix: Mix) -> torch.Tensor:
        """RecurrentState.run for one token from the fixed slot, without touching the host's marks."""
        block, slot = self.state._blocks[layer_idx], self.slots[layer_idx]
        output, (window, state) = mix(inputs, block.start(slot))
        block.store(1 - slot, window, state)
        block.inputs[:, :1].copy_(inputs)
        return output

    def end(self) -> None:
        position = self.state._position  # the step's token's
        for index, slot in self.slots.items():
            block = self.state._blocks[index]
            block.positions[1 - slot] = position + 1
            block.inputs_at, block.inputs_count = position, 1
