import pytest
import torch

from bloompeer.p2p import (
    WIRE_DTYPES, BackwardRequest, CloseSession, ErrorCode, ErrorFrame, ForwardRequest, Gradients, OpenSession,
    ProtocolError, PushStep, PushTarget, ServerInfo, SessionReady, Step, StepOutput, decode_message, pack,
    tensor_to_wire, unpack,
)
from bloompeer.p2p import codecs
from bloompeer.p2p.reachability import DialbackRequest, DialbackResult

MESSAGES = [
    OpenSession("m", 0, 4, 2, 128, 2.5),
    SessionReady("ab" * 16),
    Step(5, torch.randn(2, 1, 8)),
    Step(0, torch.randn(2, 3, 8), torch.tensor([[False, True, True], [True, True, True]]), torch.tensor([1, 0])),
    StepOutput(torch.randn(1, 1, 8).to(torch.bfloat16), 7),
    Step(3, torch.randn(1, 1, 8), step_id=9, push=(PushTarget("peerB", "s1"), PushTarget("peerC", "s2"))),
    Step(0, torch.randn(2, 5, 8), prompts=torch.randn(3, 2, 4, 8)),
    PushStep("s1", Step(3, torch.randn(1, 1, 8), step_id=9, push=(PushTarget("peerC", "s2"),))),
    CloseSession(),
    ForwardRequest("m", 1, 2, torch.randn(1, 4, 8), torch.ones(1, 4, dtype=torch.bool)),
    ErrorFrame(ErrorCode.BUSY, "no room"),
    ServerInfo("m", 0, 4, "online", "0.1.0", "float32", 1024, 2),
    DialbackRequest(("/ip4/10.0.0.1/tcp/4000", "/ip6/::1/tcp/4000")),
    DialbackResult(("/ip4/10.0.0.1/tcp/4000",)),
]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Step):
        return all(_equal(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_through_bytes(message):
    decoded = decode_message(unpack(pack(message.to_wire())), type(message))
    assert type(decoded) is type(message)
    assert all(_equal(getattr(message, f), getattr(decoded, f)) for f in message.__dataclass_fields__)


@pytest.mark.parametrize("frame", [
    {"type": "open", "model": "m", "start": 0, "end": 4, "batch": 1},  # missing max_length
    {"type": "open", "model": "m", "start": 0, "end": 4, "batch": 1, "max_length": 8, "evil": 1},
    {"type": "open", "model": "m", "start": -1, "end": 4, "batch": 1, "max_length": 8},
    {"type": "open", "model": "m", "start": 0, "end": 4, "batch": 0, "max_length": 8},
    {"type": "open", "model": "m", "start": True, "end": 4, "batch": 1, "max_length": 8},
    {"type": "open", "model": 5, "start": 0, "end": 4, "batch": 1, "max_length": 8},
    {"type": "open", "model": "m" * 5000, "start": 0, "end": 4, "batch": 1, "max_length": 8},
    {"type": "step", "position": 0},
    {"type": "step", "position": "0", "hidden": None},
    {"type": "step", "position": 0, "hidden": {**tensor_to_wire(torch.zeros(1, 1, 2)), "dtype": "int64"}},
    {"type": "step", "position": 0, "hidden": tensor_to_wire(torch.zeros(1, 1, 2)), "push": [{"peer": "x"}]},
    {"type": "step", "position": 0, "hidden": tensor_to_wire(torch.zeros(1, 1, 2)), "push": "x"},
    {"type": "step", "position": 0, "hidden": tensor_to_wire(torch.zeros(1, 1, 2)),
     "push": [{"peer": "x", "session": "y"}] * 65},
    {"type": "unknown"},
    {"no_type": 1},
])
def test_malformed_frames_are_refused(frame):
    with pytest.raises(ProtocolError):
        decode_message(frame, OpenSession, Step, CloseSession)


def test_only_expected_types_are_accepted():
    with pytest.raises(ProtocolError):
        decode_message(CloseSession().to_wire(), OpenSession)
    with pytest.raises(ProtocolError):  # a client cannot send the server an error frame as a request
        decode_message(ErrorFrame(ErrorCode.INTERNAL, "x").to_wire(), OpenSession, Step)


def test_unknown_error_code_from_a_newer_peer_reads_as_internal():
    frame = {"type": "error", "code": "brand_new_code", "message": "?"}
    assert decode_message(frame, ErrorFrame).code is ErrorCode.INTERNAL


@pytest.mark.parametrize("frame", [
    {"type": "dialback", "maddrs": "/ip4/1.2.3.4/tcp/1"},
    {"type": "dialback", "maddrs": ["/ip4/1.2.3.4/tcp/1"] * 9},
    {"type": "dialback", "maddrs": [7]},
    {"type": "dialback_result", "reachable": [None]},
    {"type": "dialback", "maddrs": [], "extra": 1},
])
def test_malformed_dialback_frames_are_refused(frame):
    with pytest.raises(ProtocolError):
        decode_message(frame, DialbackRequest, DialbackResult)


_HIDDEN, _MASK, _PROMPTS = torch.randn(1, 2, 8), torch.ones(1, 2, dtype=torch.bool), torch.randn(2, 1, 2, 8)
_TENSOR_FIELDS = [  # (a valid frame, a tensor field of it, that field's ndim)
    (Step(0, _HIDDEN, _MASK, torch.tensor([0]), prompts=_PROMPTS), "hidden", 3),
    (Step(0, _HIDDEN, _MASK, torch.tensor([0]), prompts=_PROMPTS), "padding_mask", 2),
    (Step(0, _HIDDEN, _MASK, torch.tensor([0]), prompts=_PROMPTS), "hypo_ids", 1),
    (Step(0, _HIDDEN, _MASK, torch.tensor([0]), prompts=_PROMPTS), "prompts", 4),
    (PushStep("s", Step(0, _HIDDEN)), "hidden", 3),
    (StepOutput(_HIDDEN), "hidden", 3),
    (ForwardRequest("m", 0, 2, _HIDDEN, _MASK, _PROMPTS), "hidden", 3),
    (ForwardRequest("m", 0, 2, _HIDDEN, _MASK, _PROMPTS), "padding_mask", 2),
    (ForwardRequest("m", 0, 2, _HIDDEN, _MASK, _PROMPTS), "prompts", 4),
    (BackwardRequest("m", 0, 2, _HIDDEN, _HIDDEN, _MASK, _PROMPTS), "hidden", 3),
    (BackwardRequest("m", 0, 2, _HIDDEN, _HIDDEN, _MASK, _PROMPTS), "grad_output", 3),
    (BackwardRequest("m", 0, 2, _HIDDEN, _HIDDEN, _MASK, _PROMPTS), "prompts", 4),
    (Gradients(_HIDDEN, _PROMPTS), "grad_hidden", 3),
    (Gradients(_HIDDEN, _PROMPTS), "grad_prompts", 4),
]


@pytest.mark.parametrize("message, field, ndim", _TENSOR_FIELDS, ids=lambda x: getattr(x, "TYPE", str(x)))
@pytest.mark.parametrize("extra_dims", [-1, 1])
def test_a_tensor_of_the_wrong_ndim_is_refused_before_it_is_decoded(monkeypatch, message, field, ndim, extra_dims):
    """A peer's 4-D hidden states were decoded (int8-blockwise: 4 bytes per byte received, plus
    intermediates) before the server saw they were not 3-D."""
    wire = message.to_wire()
    assert decode_message(wire, type(message)) is not None and len(wire[field]["shape"]) == ndim
    sizes = {-1: [2] * (ndim - 1), 1: [2] * (ndim + 1)}[extra_dims]
    wire[field] = tensor_to_wire(torch.zeros(sizes, dtype=WIRE_DTYPES[wire[field]["dtype"]]))
    decode = codecs.decode

    def decode_the_others(data, *args):
        assert data is not wire[field]["data"], "decoded before its ndim was checked"
        return decode(data, *args)

    monkeypatch.setattr(codecs, "decode", decode_the_others)
    with pytest.raises(ProtocolError, match=f"{field}: shape must be {ndim} dims"):
        decode_message(wire, type(message))


@pytest.mark.parametrize("maddr", ["/ip4/1.2.3.4/tcp/65536", "/ip4/1.2.3.4/tcp/0", "/ip4/1.2.3.4/tcp/²", "1.2.3.4:80",
                                   "/ip4/1.2.3.4/tcp/80/p2p-circuit"])
def test_a_dialback_request_names_plain_addresses_only(maddr):
    with pytest.raises(ProtocolError) as info:
        decode_message({"type": "dialback", "maddrs": ["/ip4/1.2.3.4/tcp/1", maddr]}, DialbackRequest)
    assert info.value.code is ErrorCode.BAD_REQUEST


def test_a_dialback_result_is_bounded():
    with pytest.raises(ProtocolError):
        decode_message({"type": "dialback_result", "reachable": ["/ip4/1.2.3.4/tcp/1"] * 9}, DialbackResult)
