"""Every frame of bloompeer's RPCs, as a typed dataclass; the one place wire field names live.

Each frame is a msgpack map with a "type" and that type's fields, nothing else. `to_wire`
builds the map; `from_wire` checks it (known fields only, each with its type) and raises
ProtocolError otherwise. Checks that need the model or the session (hidden size, batch,
positions) belong to the server, which knows them.

    inference (one stream per session and span):
        client: OpenSession -> server: SessionReady | ErrorFrame
        client: Step        -> server: StepOutput   | ErrorFrame    (repeated)
        client: CloseSession, or end of stream
    push (server to server, one way; the receiver answers on its own client's inference stream):
        server: PushStep -> next server, which sends StepOutput | ErrorFrame to the session's client
    forward:  client: ForwardRequest  -> server: StepOutput | ErrorFrame
    backward: client: BackwardRequest -> server: Gradients  | ErrorFrame
    info:     server: ServerInfo (as soon as the stream opens)
    dialback: see reachability.py
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .codecs import CODECS
from .errors import ErrorCode, ProtocolError
from .tensors import FLOAT_DTYPES, tensor_from_wire, tensor_to_wire, optional_tensor_to_wire as _optional_tensor

__all__ = [
    "PROTOCOL_VERSION", "INFO_PROTOCOL", "INFERENCE_PROTOCOL", "FORWARD_PROTOCOL", "BACKWARD_PROTOCOL", "PUSH_PROTOCOL",
    "Message", "BackwardRequest", "Gradients", "MAX_STRING_CHARS", "Fields",
    "OpenSession", "SessionReady", "Step", "StepOutput", "CloseSession", "ForwardRequest", "ErrorFrame",
    "PushStep", "PushTarget", "ServerInfo", "decode_message",
]

PROTOCOL_VERSION = 1
INFO_PROTOCOL = f"bloompeer.info/{PROTOCOL_VERSION}"
INFERENCE_PROTOCOL = f"bloompeer.inference/{PROTOCOL_VERSION}"
PUSH_PROTOCOL = f"bloompeer.push/{PROTOCOL_VERSION}"
FORWARD_PROTOCOL = f"bloompeer.forward/{PROTOCOL_VERSION}"
BACKWARD_PROTOCOL = f"bloompeer.backward/{PROTOCOL_VERSION}"

MAX_STRING_CHARS = 1024
MAX_WAIT_S = 3600.0  # the longest a client may ask a server to wait for anything
# every tensor field: its dtypes and number of dims (checked before its bytes are decoded). Hidden states
# and their gradients are [batch, tokens, hidden size], deep prompts [blocks, batch, tokens, hidden size]
_TENSOR_FIELDS: dict[str, tuple[frozenset[str], int]] = {
    "hidden": (FLOAT_DTYPES, 3), "grad_output": (FLOAT_DTYPES, 3), "grad_hidden": (FLOAT_DTYPES, 3),
    "prompts": (FLOAT_DTYPES, 4), "grad_prompts": (FLOAT_DTYPES, 4),
    "padding_mask": (frozenset({"bool"}), 2), "hypo_ids": (frozenset({"int64"}), 1),  # [batch, tokens], [batch]
}


class Fields:
    """Typed access to the fields of one received frame; refuses unknown and missing ones."""

    def __init__(self, message: dict[str, Any], type_name: str, required: set[str], optional: set[str] = frozenset()):
        unknown = set(message) - required - optional - {"type"}
        if unknown:
            raise ProtocolError(f"{type_name}: unknown field(s) {sorted(map(str, unknown))}")
        missing = required - set(message)
        if missing:
            raise ProtocolError(f"{type_name}: missing field(s) {sorted(missing)}")
        self.message, self.type_name = message, type_name

    def int(self, name: str, minimum: int = 0) -> int:
        value = self.message[name]
        if type(value) is not int or value < minimum:
            raise ProtocolError(f"{self.type_name}.{name} must be an int >= {minimum}")
        return value

    def float(self, name: str, maximum: float) -> float:
        value = self.message[name]
        if type(value) not in (int, float) or not 0 <= value <= maximum:
            raise ProtocolError(f"{self.type_name}.{name} must be a number in [0, {maximum}]")
        return float(value)

    def codec(self, name: str) -> str:
        value = self.message.get(name, "raw")
        if not isinstance(value, str) or value not in CODECS:
            raise ProtocolError(f"{self.type_name}.{name} must be one of {sorted(CODECS)}", ErrorCode.UNSUPPORTED)
        return value

    def str(self, name: str) -> str:
        value = self.message[name]
        if not isinstance(value, str) or len(value) > MAX_STRING_CHARS:
            raise ProtocolError(f"{self.type_name}.{name} must be a string of at most {MAX_STRING_CHARS} chars")
        return value

    def tensor(self, name: str) -> torch.Tensor | None:
        if self.message.get(name) is None:
            return None
        return tensor_from_wire(self.message[name], f"{self.type_name}.{name}", *_TENSOR_FIELDS[name])


class Message:
    TYPE: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Message:
        raise NotImplementedError


@dataclass(frozen=True)
class OpenSession(Message):
    """Reserve a KV cache for `batch` x `max_length` tokens over blocks [start, end).

    alloc_timeout_s: how long the client is willing to wait for cache room on a busy server.
    """

    TYPE: ClassVar[str] = "open"
    model: str
    start: int
    end: int
    batch: int
    max_length: int
    alloc_timeout_s: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "model": self.model, "start": self.start, "end": self.end,
                "batch": self.batch, "max_length": self.max_length, "alloc_timeout_s": self.alloc_timeout_s}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> OpenSession:
        f = Fields(message, cls.TYPE, {"model", "start", "end", "batch", "max_length"}, {"alloc_timeout_s"})
        alloc_timeout_s = f.float("alloc_timeout_s", MAX_WAIT_S) if "alloc_timeout_s" in message else 0.0
        return cls(f.str("model"), f.int("start"), f.int("end", 1), f.int("batch", 1), f.int("max_length", 1),
                   alloc_timeout_s)


@dataclass(frozen=True)
class SessionReady(Message):
    """session_id: a random token; whoever holds it may push steps into this session (the client
    gives it to the previous server of its chain)."""

    TYPE: ClassVar[str] = "ready"
    session_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "session_id": self.session_id}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> SessionReady:
        return cls(Fields(message, cls.TYPE, {"session_id"}).str("session_id"))


@dataclass(frozen=True)
class PushTarget:
    """The next hop of a server-to-server push: a server and a session open there."""

    peer_id_str: str
    session_id: str

    def to_wire(self) -> dict[str, Any]:
        return {"peer": self.peer_id_str, "session": self.session_id}


MAX_PUSH_HOPS = 64
_STEP_OPTIONAL = frozenset({"padding_mask", "hypo_ids", "step_id", "push", "prompts"})


def _push_targets(f: Fields, name: str) -> tuple[PushTarget, ...]:
    value = f.message.get(name) or []
    if not isinstance(value, list) or len(value) > MAX_PUSH_HOPS:
        raise ProtocolError(f"{f.type_name}.{name} must be a list of at most {MAX_PUSH_HOPS} hops")
    targets = []
    for hop in value:
        hop_fields = Fields(hop if isinstance(hop, dict) else {}, f"{f.type_name}.{name}[]", {"peer", "session"})
        targets.append(PushTarget(hop_fields.str("peer"), hop_fields.str("session")))
    return tuple(targets)


@dataclass(frozen=True)
class Step(Message):
    """Run the new tokens' hidden states through the span.

    position: tokens already in the cache that these follow (a smaller value rewinds, so a
    client can replay a prefix). padding_mask: [batch, new] bool, False at padding; absent
    means no padding. hypo_ids: [batch] int64, beam search's reordering of the cached rows.
    step_id: the client's number for this step, echoed in the output (so a late answer to an
    abandoned step is recognised). push: the rest of the chain; the server sends its output
    on to the first hop as a PushStep (and to the client as usual). prompts: [the span's blocks,
    batch, k <= new, hidden] deep prompts for the first k new tokens (never pushed on).
    """

    TYPE: ClassVar[str] = "step"
    position: int
    hidden: torch.Tensor  # [batch, new, hidden_size]
    padding_mask: torch.Tensor | None = None
    hypo_ids: torch.Tensor | None = None
    step_id: int = 0
    push: tuple[PushTarget, ...] = ()
    prompts: torch.Tensor | None = None

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "position": self.position, "hidden": tensor_to_wire(self.hidden),
                "padding_mask": _optional_tensor(self.padding_mask), "hypo_ids": _optional_tensor(self.hypo_ids),
                "step_id": self.step_id, "push": [hop.to_wire() for hop in self.push],
                "prompts": _optional_tensor(self.prompts)}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Step:
        f = Fields(message, cls.TYPE, {"position", "hidden"}, _STEP_OPTIONAL)
        return cls._from_fields(f)

    @classmethod
    def _from_fields(cls, f: Fields) -> Step:
        return cls(f.int("position"), f.tensor("hidden"), f.tensor("padding_mask"), f.tensor("hypo_ids"),
                   f.int("step_id") if "step_id" in f.message else 0, _push_targets(f, "push"), f.tensor("prompts"))


@dataclass(frozen=True)
class PushStep(Message):
    """A step pushed by the previous server of a client's chain into session `session_id` here."""

    TYPE: ClassVar[str] = "push"
    session_id: str
    step: Step

    def to_wire(self) -> dict[str, Any]:
        return {**self.step.to_wire(), "type": self.TYPE, "session_id": self.session_id}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> PushStep:
        f = Fields(message, cls.TYPE, {"session_id", "position", "hidden"}, _STEP_OPTIONAL)
        return cls(f.str("session_id"), Step._from_fields(f))


@dataclass(frozen=True)
class StepOutput(Message):
    TYPE: ClassVar[str] = "output"
    hidden: torch.Tensor  # [batch, new, hidden_size]
    step_id: int = 0  # the step's, for inference
    codec: str = "raw"  # how the sender packs it (not a wire field: the tensor says its own)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "hidden": tensor_to_wire(self.hidden, self.codec), "step_id": self.step_id}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> StepOutput:
        f = Fields(message, cls.TYPE, {"hidden"}, {"step_id"})
        return cls(f.tensor("hidden"), f.int("step_id") if "step_id" in message else 0)


@dataclass(frozen=True)
class CloseSession(Message):
    TYPE: ClassVar[str] = "close"

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> CloseSession:
        Fields(message, cls.TYPE, set())
        return cls()


@dataclass(frozen=True)
class ForwardRequest(Message):
    """A full forward of whole sequences through blocks [start, end), with no cache kept.

    prompts: [end - start, batch, prompt_length, hidden] deep prompts, added to the first
    prompt_length positions before each block (prompt tuning). output_codec: how the server
    should pack its answer (see codecs.py).
    """

    TYPE: ClassVar[str] = "forward"
    model: str
    start: int
    end: int
    hidden: torch.Tensor  # [batch, length, hidden_size]
    padding_mask: torch.Tensor | None = None  # [batch, length] bool
    prompts: torch.Tensor | None = None
    output_codec: str = "raw"
    codec: str = "raw"  # how the sender packs its own tensors (not a wire field: each tensor says its own)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "model": self.model, "start": self.start, "end": self.end,
                "hidden": tensor_to_wire(self.hidden, self.codec), "padding_mask": _optional_tensor(self.padding_mask),
                "prompts": _optional_tensor(self.prompts, self.codec), "output_codec": self.output_codec}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> ForwardRequest:
        f = Fields(message, cls.TYPE, {"model", "start", "end", "hidden"}, {"padding_mask", "prompts", "output_codec"})
        return cls(f.str("model"), f.int("start"), f.int("end", 1), f.tensor("hidden"), f.tensor("padding_mask"),
                   f.tensor("prompts"), f.codec("output_codec"))


@dataclass(frozen=True)
class BackwardRequest(Message):
    """Gradients through blocks [start, end): of the loss with respect to the span's input hidden
    states (and to the deep prompts, if any), given the gradient with respect to its output.

    The server recomputes the forward of `hidden` with autograd; its weights stay frozen.
    """

    TYPE: ClassVar[str] = "backward"
    model: str
    start: int
    end: int
    hidden: torch.Tensor  # [batch, length, hidden_size], the span's input
    grad_output: torch.Tensor  # [batch, length, hidden_size]
    padding_mask: torch.Tensor | None = None
    prompts: torch.Tensor | None = None
    output_codec: str = "raw"
    codec: str = "raw"  # how the sender packs its own tensors (not a wire field: each tensor says its own)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "model": self.model, "start": self.start, "end": self.end,
                "hidden": tensor_to_wire(self.hidden, self.codec),
                "grad_output": tensor_to_wire(self.grad_output, self.codec),
                "padding_mask": _optional_tensor(self.padding_mask),
                "prompts": _optional_tensor(self.prompts, self.codec), "output_codec": self.output_codec}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> BackwardRequest:
        f = Fields(message, cls.TYPE, {"model", "start", "end", "hidden", "grad_output"},
                   {"padding_mask", "prompts", "output_codec"})
        return cls(f.str("model"), f.int("start"), f.int("end", 1), f.tensor("hidden"), f.tensor("grad_output"),
                   f.tensor("padding_mask"), f.tensor("prompts"), f.codec("output_codec"))


@dataclass(frozen=True)
class Gradients(Message):
    TYPE: ClassVar[str] = "gradients"
    grad_hidden: torch.Tensor  # [batch, length, hidden_size]
    grad_prompts: torch.Tensor | None = None  # like the request's prompts
    codec: str = "raw"  # how the sender packs them (not a wire field: each tensor says its own)

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "grad_hidden": tensor_to_wire(self.grad_hidden, self.codec),
                "grad_prompts": _optional_tensor(self.grad_prompts, self.codec)}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Gradients:
        f = Fields(message, cls.TYPE, {"grad_hidden"}, {"grad_prompts"})
        return cls(f.tensor("grad_hidden"), f.tensor("grad_prompts"))


@dataclass(frozen=True)
class ErrorFrame(Message):
    TYPE: ClassVar[str] = "error"
    code: ErrorCode
    message: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "code": self.code.value, "message": self.message[:MAX_STRING_CHARS]}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> ErrorFrame:
        f = Fields(message, cls.TYPE, {"code", "message"})
        code_str = f.str("code")
        try:
            code = ErrorCode(code_str)
        except ValueError:
            code = ErrorCode.INTERNAL  # a newer peer's code: treat as a generic failure
        return cls(code, f.str("message"))


@dataclass(frozen=True)
class ServerInfo(Message):
    """What a server says about itself to anyone who asks (also a cheap ping)."""

    TYPE: ClassVar[str] = "info"
    model: str
    start: int
    end: int
    state: str
    version: str
    dtype: str
    cache_tokens_left: int
    sessions: int  # open inference sessions

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "model": self.model, "start": self.start, "end": self.end,
                "state": self.state, "version": self.version, "dtype": self.dtype,
                "cache_tokens_left": self.cache_tokens_left, "sessions": self.sessions}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> ServerInfo:
        f = Fields(message, cls.TYPE, {"model", "start", "end", "state", "version", "dtype", "cache_tokens_left",
                                       "sessions"})
        return cls(f.str("model"), f.int("start"), f.int("end"), f.str("state"), f.str("version"), f.str("dtype"),
                   f.int("cache_tokens_left"), f.int("sessions"))


def decode_message(message: dict[str, Any], *expected: type[Message]) -> Message:
    """Decode a frame into one of the `expected` message types, refusing any other type."""
    by_type = {cls.TYPE: cls for cls in expected}
    type_name = message.get("type")
    if not isinstance(type_name, str) or type_name not in by_type:
        allowed = sorted(cls.TYPE for cls in expected)
        raise ProtocolError(f"expected a frame of type {allowed}, got {str(type_name)[:40]!r}")
    return by_type[type_name].from_wire(message)
