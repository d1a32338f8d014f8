"""Gated DeltaNet (blocks/gated_deltanet.py, delta_rule.py) against transformers' own layers
(Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet) on the same random weights in float32, and the
per-session recurrent state (blocks/recurrent_state.py): rollback, batching, beam reordering, a
failed pass, its bytes.

transformers runs a prompt with the chunked rule and a one-token step after a state with the
recurrent one; ours makes the same choice, and each is compared with its own bitwise, measured on
this machine (the convolution and sigmoid are written in transformers' very layouts for that, see
delta_rule.causal_conv). A pass of a few tokens after a state (a speculative step) runs as one-token
steps, as transformers' assisted generation runs its drafts: bitwise what those steps give, and
within 1e-5 of transformers' plain forward, which would chunk it (measured: 2.4e-7)"""

import pytest
import torch
from transformers import DynamicCache, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from bloompeer.blocks.gated_deltanet import RECURRENT_PASS_TOKENS, DeltaNetSegment, GatedDeltaNet, Qwen35GatedDeltaNet
from bloompeer.blocks.recurrent_state import RecurrentState, RewindError

HIDDEN = 32
LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
SHAPES = dict(hidden_size=HIDDEN, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=4, layer_types=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
VARIANTS = {  # name -> (config, transformers' layer, ours)
    "qwen3_next": (lambda: Qwen3NextConfig(**SHAPES, num_experts=4), Qwen3NextGatedDeltaNet, GatedDeltaNet),
    "qwen3_5_text": (lambda: Qwen3_5TextConfig(**SHAPES), Qwen3_5GatedDeltaNet, Qwen35GatedDeltaNet),
}


def _module_call(module, rows):
    return module(rows)


def _row_by_row(module, rows):
    """A linear layer whose every output row is computed alone: a row's bits never depend on how many rows
    share the call (as the span's batched-pass kernel guarantees), so tests of the state see only the state."""
    flat = rows.reshape(-1, rows.shape[-1])
    return torch.stack([module(row) for row in flat]).view(*rows.shape[:-1], -1)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def layers(request):
    """(config, transformers' layers 0 and 1, ours with the same weights)."""
    make_config, reference_class, our_class = VARIANTS[request.param]
    config = make_config()
    torch.manual_seed(0)
    references, ours = [], []
    for index in (0, 1):
        reference = reference_class(config, index).eval()
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.normal_(0, 0.3)
        layer = our_class(config, index)
        layer.load_state_dict(reference.state_dict())
        references.append(reference)
        ours.append(layer)
    return config, references, ours


def _ours(layer, state, hidden, position, linear=_module_call, mask=None):
    state.begin_step(position, hidden.shape[1])
    with torch.no_grad():
        return layer.compute(hidden, linear, [DeltaNetSegment(*hidden.shape[:2], state, mask)])


def _state(layers, batch=2, **kwargs):
    return RecurrentState(layers[0].layout, [layer.layer_idx for layer in layers], batch, torch.float32, **kwargs)


@pytest.mark.parametrize("prompt_length", [2, 5, 64, 70, 130])
def test_a_prompt_then_steps_equal_transformers(layers, prompt_length):
    """Shorter than the kernel, than a chunk, one chunk, across chunks; then one-token steps (the recurrent
    rule), a pass of 40 tokens after a state (the chunked rule from it) and one of 3 (the recurrent rule,
    where transformers' plain forward chunks: within 1e-5 of it)."""
    config, (reference, _), (ours, _) = layers
    torch.manual_seed(prompt_length)
    hidden = torch.randn(2, prompt_length + 45, HIDDEN)
    cache, state = DynamicCache(config=config), _state([ours])
    passes = [(0, prompt_length), (prompt_length, 1), (prompt_length + 1, 1), (prompt_length + 2, 40),
              (prompt_length + 42, 3)]
    for position, length in passes:
        part = hidden[:, position:position + length]
        with torch.no_grad():
            expected = reference(part, cache=cache)
        tolerance = 1e-5 if 1 < length <= RECURRENT_PASS_TOKENS and position else 0
        torch.testing.assert_close(_ours(ours, state, part, position), expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("drafts", [1, 8, RECURRENT_PASS_TOKENS - 1])
def test_a_speculative_pass_computes_what_one_token_steps_compute(layers, drafts):
    """The accepted token and its drafts in one pass: each token's output and the state after them bitwise
    what stepping them one at a time gives (what plain greedy decoding computes)."""
    _, _, ours = layers
    hidden = torch.randn(2, 10 + drafts + 2, HIDDEN)
    after = 10 + 1 + drafts
    together, _ = _history(ours, hidden, [(0, 10), (10, 1 + drafts), (after, 1)])
    one_by_one, _ = _history(ours, hidden, [(0, 10)] + [(position, 1) for position in range(10, after + 1)])
    torch.testing.assert_close(together[1], torch.cat(one_by_one[1:-1], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(together[2], one_by_one[-1], rtol=0, atol=0)


def test_a_forward_without_state_equals_transformers_without_cache(layers):
    _, (reference, _), (ours, _) = layers
    hidden = torch.randn(2, 70, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ours.compute(hidden, _module_call, [DeltaNetSegment(2, 70)]), reference(hidden),
                                   rtol=0, atol=0)


def test_left_padding_equals_transformers_and_leaves_the_state_alone(layers):
    """transformers zeroes the hidden states of padding (apply_mask_to_padding_states) in a pass of several
    tokens: zero inputs leave a zero state zero, so a padded row computes its real tokens as it would alone
    (within rounding: its chunk holds the padding too; measured 1.1e-6 on values near 2)."""
    config, (reference, _), (ours, _) = layers
    hidden = torch.randn(2, 12, HIDDEN)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[0, :5] = False
    cache, state = DynamicCache(config=config), _state([ours])
    with torch.no_grad():
        expected = [reference(hidden[:, :10], cache=cache, attention_mask=mask[:, :10]),
                     reference(hidden[:, 10:11], cache=cache), reference(hidden[:, 11:], cache=cache)]
    got = [_ours(ours, state, hidden[:, :10], 0, mask=mask[:, :10]), _ours(ours, state, hidden[:, 10:11], 10),
           _ours(ours, state, hidden[:, 11:], 11)]
    for ours_part, expected_part in zip(got, expected):
        torch.testing.assert_close(ours_part, expected_part, rtol=0, atol=0)
    alone_state = _state([ours], batch=1)
    alone = [_ours(ours, alone_state, hidden[:1, 5:10], 0), _ours(ours, alone_state, hidden[:1, 10:11], 5)]
    torch.testing.assert_close(got[0][:1, 5:], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1][:1], alone[1], rtol=0, atol=1e-5)


def test_beam_reordering_equals_transformers(layers):
    config, (reference, _), (ours, _) = layers
    hidden = torch.randn(3, 8, HIDDEN)
    cache, state = DynamicCache(config=config), _state([ours], batch=3)
    with torch.no_grad():
        reference(hidden[:, :6], cache=cache)
    _ours(ours, state, hidden[:, :6], 0)
    hypo_ids = torch.tensor([2, 2, 0])
    cache.reorder_cache(hypo_ids)
    state.reorder(hypo_ids)
    with torch.no_grad():
        expected = reference(hidden[:, 6:7], cache=cache)
    torch.testing.assert_close(_ours(ours, state, hidden[:, 6:7], 6), expected, rtol=0, atol=0)


def _history(layers, hidden, passes, linear=_row_by_row, **kwargs):
    """Run `passes` [(position, length)] of hidden through both blocks; (each pass's outputs, the state)."""
    state = _state(layers, batch=hidden.shape[0], **kwargs)
    outputs = []
    for position, length in passes:
        part = hidden[:, position:position + length]
        state.begin_step(position, length)
        with torch.no_grad():
            segment = [DeltaNetSegment(*part.shape[:2], state)]
            outputs.append(torch.stack([layer.compute(part, linear, segment) for layer in layers]))
    return outputs, state


@pytest.mark.parametrize("prompt_length", [5, 70])
@pytest.mark.parametrize("pass_length, rejected", [(9, 0), (9, 1), (9, 4), (9, 8), (9, 9), (20, 2), (20, 6)])
def test_rolling_back_rejected_drafts_equals_never_sending_them(layers, prompt_length, pass_length, rejected):
    """A speculative pass (the accepted token and its drafts), `rejected` of its tokens rolled back, then
    the next passes: bitwise what the session computes had it sent only the accepted ones (all rejected:
    back to the pass's start, which a client's rewind may ask). A pass of 20 runs the chunked algorithm,
    and so does re-advancing over 18 accepted tokens, as a pass of those 18 would."""
    _, _, ours = layers
    hidden = torch.randn(2, prompt_length + pass_length + 3, HIDDEN)
    accepted = pass_length - rejected
    after = prompt_length + accepted
    drafted, _ = _history(ours, hidden, [(0, prompt_length), (prompt_length, pass_length), (after, 1),
                                         (after + 1, 2)])
    sent = [(0, prompt_length)] + ([(prompt_length, accepted)] if accepted else []) + [(after, 1), (after + 1, 2)]
    clean, _ = _history(ours, hidden, sent)
    for got, expected in zip(drafted[-2:], clean[-2:]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_rewind_before_the_last_pass_is_refused_but_zero_is_a_fresh_start(layers):
    _, _, ours = layers
    hidden = torch.randn(2, 20, HIDDEN)
    _, state = _history(ours, hidden, [(0, 5), (5, 3), (8, 4)])
    with pytest.raises(RewindError, match="within its last step"):
        state.begin_step(7, 1)
    with pytest.raises(RewindError):
        state.begin_step(13, 1)  # past the end
    fresh, _ = _history(ours, hidden, [(0, 6)])
    state.begin_step(0, 6)
    with torch.no_grad():
        again = torch.stack([layer.compute(hidden[:, :6], _row_by_row, [DeltaNetSegment(2, 6, state)])
                             for layer in ours])
    torch.testing.assert_close(again, fresh[0], rtol=0, atol=0)


def test_a_fresh_start_forgets_the_abandoned_history(layers):
    """After a rewind to 0, no state of the earlier tokens is ever read again: here a rewind into the new
    prompt lands on a position the abandoned history also reached."""
    _, _, ours = layers
    old, new = torch.randn(2, 6, HIDDEN), torch.randn(2, 12, HIDDEN)
    _, state = _history(ours, old, [(0, 3), (3, 1)])
    for position, length, hidden in [(0, 10, new), (4, 1, new)]:
        state.begin_step(position, length)
        with torch.no_grad():
            got = torch.stack([layer.compute(hidden[:, position:position + length], _row_by_row,
                                             [DeltaNetSegment(2, length, state)]) for layer in ours])
    clean, _ = _history(ours, new, [(0, 4), (4, 1)])
    torch.testing.assert_close(got, clean[-1], rtol=0, atol=0)


def test_a_pass_longer_than_max_rollback_is_kept_only_at_its_ends(layers):
    _, _, ours = layers
    hidden = torch.randn(2, 20, HIDDEN)
    _, state = _history(ours, hidden, [(0, 5), (5, 6)], max_rollback=4)
    state.begin_step(5, 1)  # the pass's start: the state kept before it
    _, state = _history(ours, hidden, [(0, 5), (5, 6)], max_rollback=4)
    with pytest.raises(RewindError, match="at most 4 tokens"):
        state.begin_step(7, 1)


def test_sessions_in_one_pass_each_equal_their_pass_alone(layers):
    """Three sessions with different histories (a short prompt, one across chunks, a fresh one), and a
    rollback in one of them, stepped in one pass: each equals its own pass alone, bitwise."""
    _, _, ours = layers
    hidden = torch.randn(3, 90, HIDDEN)
    histories = [[(0, 5), (5, 4)], [(0, 70), (70, 1)], []]
    nexts = [(7, 1), (71, 3), (0, 6)]  # the first rolls 2 drafts back
    alone = [_history(ours, hidden[i:i + 1], history + [step])[0][-1] for i, (history, step) in
             enumerate(zip(histories, nexts))]
    states = [_history(ours, hidden[i:i + 1], history)[1] for i, history in enumerate(histories)]
    parts = []
    for index, (state, (position, length)) in enumerate(zip(states, nexts)):
        state.begin_step(position, length)
        parts.append(hidden[index, position:position + length])
    segments = [DeltaNetSegment(1, length, state) for state, (_, length) in zip(states, nexts)]
    with torch.no_grad():
        together = torch.stack([layer.compute(torch.cat(parts), _row_by_row, segments) for layer in ours])
    for got, expected in zip(together.split([length for _, length in nexts], dim=1), alone):
        torch.testing.assert_close(got, expected.flatten(1, 2), rtol=0, atol=0)


def test_a_pass_that_fails_halfway_can_run_again(layers):
    """The scheduler reruns a failed batch's requests alone: a block that wrote its new state and one that
    failed before writing must both start the same step again, here one that also rolls drafts back."""
    _, _, ours = layers
    hidden = torch.randn(2, 20, HIDDEN)
    clean, _ = _history(ours, hidden, [(0, 5), (5, 4), (7, 2)])
    _, state = _history(ours, hidden, [(0, 5), (5, 4)])
    state.begin_step(7, 2)
    part = hidden[:, 7:9]
    segment = [DeltaNetSegment(2, 2, state)]

    def failing(inputs, start):
        raise RuntimeError("out of memory")

    with torch.no_grad():
        ours[0].compute(part, _row_by_row, segment)
        with pytest.raises(RuntimeError):
            state.run(ours[1].layer_idx, torch.zeros(2, 2, ours[1].layout.input_width), failing)
        state.length = 7  # as the scheduler's rollback sets a session's length back
        state.begin_step(7, 2)
        again = torch.stack([layer.compute(part, _row_by_row, segment) for layer in ours])
    torch.testing.assert_close(again, clean[-1], rtol=0, atol=0)


def test_its_bytes_are_per_session_and_what_it_allocates(layers):
    _, _, ours = layers
    layout = ours[0].layout
    assert (layout.conv_dim, layout.conv_window, layout.heads) == (2 * 16 + 32, 3, 4)
    state = _state(ours, batch=2, max_rollback=8)
    allocated = sum(tensor.numel() * tensor.element_size() for block in state._blocks.values()
                    for tensor in (block.states, block.windows, block.inputs))
    assert RecurrentState.nbytes(layout, 2, 2, torch.float32, max_rollback=8) == allocated
    # two float32 states of 4 heads x 8 x 8, two windows of 64 x 3 and 8 tokens' inputs of 64 + 8, per row
    assert layout.nbytes(1, torch.float32, 8) == 2 * 4 * 64 * 4 + 2 * 64 * 3 * 4 + 8 * 72 * 4
    assert layout.nbytes(1, torch.bfloat16, 8) == 2 * 4 * 64 * 4 + 2 * 64 * 3 * 2 + 8 * 72 * 2
