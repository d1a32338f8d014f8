"""Seeded fuzzing of the wire decoders: whatever bytes a peer sends, decoding either succeeds or
raises ProtocolError; nothing else escapes (no crash, no other exception type, no hang). And every
well-formed frame, of random valid sizes, dtypes and optional fields, decodes to what was sent."""

import random

import torch

from bloompeer.p2p import (
    CODECS, CloseSession, ErrorCode, ErrorFrame, ForwardRequest, OpenSession, ProtocolError, PushStep, PushTarget,
    ServerInfo, SessionReady, Step, StepOutput, decode_message, pack, unpack,
)
from bloompeer.p2p.records import RequestLimits, ServerRecord, ServerState
from bloompeer.weight_format import WeightFormat

ALL_TYPES = (OpenSession, SessionReady, Step, StepOutput, CloseSession, ForwardRequest, ErrorFrame, ServerInfo,
             PushStep)
SEEDS = [
    OpenSession("m", 0, 4, 2, 128, 1.0).to_wire(),
    Step(3, torch.randn(2, 3, 8), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1, 0]), 5,
         (PushTarget("p", "s"),)).to_wire(),
    ForwardRequest("m", 0, 2, torch.randn(1, 4, 8).half()).to_wire(),
    PushStep("s", Step(0, torch.randn(1, 1, 8).to(torch.bfloat16))).to_wire(),
]
ODD_VALUES = [None, True, -1, 2**63 - 1, -(2**63), 1.5, float("nan"), float("inf"), "", "x" * 5000, b"\x00" * 9,
              [], [1, 2], {}, {"dtype": "float32"}, {"a": {"b": {"c": {}}}}]


def _mutate_structure(message: dict, rng: random.Random) -> dict:
    message = dict(message)
    key = rng.choice(list(message) + ["extra"])
    action = rng.random()
    if action < 0.3:
        message.pop(key, None)
    elif action < 0.8:
        message[key] = rng.choice(ODD_VALUES)
    elif isinstance(message.get(key), dict):  # dig into a tensor map
        message[key] = _mutate_structure(message[key], rng)
    else:
        message["type"] = rng.choice([cls.TYPE for cls in ALL_TYPES] + ["nope", 7])
    return message


def _mutate_bytes(payload: bytes, rng: random.Random) -> bytes:
    data = bytearray(payload)
    for _ in range(rng.randint(1, 8)):
        choice = rng.random()
        position = rng.randrange(len(data) or 1)
        if choice < 0.5 and data:
            data[position] = rng.randrange(256)
        elif choice < 0.75:
            data[position:position] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        else:
            del data[position:position + rng.randint(1, 16)]
    return bytes(data)


def _decode_or_refuse(payload: bytes) -> None:
    try:
        decode_message(unpack(payload), *ALL_TYPES)
    except ProtocolError:
        pass


def test_structurally_mutated_frames():
    rng = random.Random(0)
    for _ in range(3000):
        _decode_or_refuse(pack(_mutate_structure(rng.choice(SEEDS), rng)))


def test_byte_mutated_frames():
    rng = random.Random(1)
    packed = [pack(seed) for seed in SEEDS]
    for _ in range(3000):
        _decode_or_refuse(_mutate_bytes(rng.choice(packed), rng))


def test_random_bytes_and_deep_nesting():
    rng = random.Random(2)
    for _ in range(1000):
        _decode_or_refuse(bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))))
    deep = b"\x81\xa1a" * 100_000 + b"\x80"  # {"a": {"a": ... {}}}, deeper than msgpack will go
    _decode_or_refuse(deep)


def test_mutated_dht_records():
    rng = random.Random(3)
    seed = ServerRecord("12D3KooW", ServerState.ONLINE, 0, 4, 10.0, 100, WeightFormat(), "0.1.0", "abc", False,
                        RequestLimits(64, 8192, 65536)).to_wire()
    for _ in range(2000):
        try:
            ServerRecord.from_wire(_mutate_structure(seed, rng))
        except ProtocolError:
            pass


def _random_valid_messages(rng: random.Random):
    """Well-formed messages of every kind with random (valid) sizes, dtypes and optional fields."""
    generator = torch.Generator().manual_seed(rng.randrange(2**31))

    def hidden(batch, length, dtype=None):
        dtype = dtype or rng.choice([torch.float32, torch.float16, torch.bfloat16])
        return torch.randn(batch, length, rng.choice([1, 8, 64]), generator=generator).to(dtype)

    def maybe(value):
        return value if rng.random() < 0.5 else None

    batch, length = rng.randint(1, 4), rng.randint(1, 6)
    x = hidden(batch, length)
    mask = maybe(torch.rand(batch, length, generator=generator) > 0.3)
    prompts = maybe(torch.randn(2, batch, rng.randint(1, length), x.shape[2], generator=generator).to(x.dtype))
    name = "".join(rng.choice("abc-/._0") for _ in range(rng.randint(1, 40)))
    start = rng.randint(0, 50)
    end = start + rng.randint(1, 20)
    yield OpenSession(name, start, end, batch, rng.randint(1, 8192), rng.choice([0.0, 2.5, 60]))
    yield SessionReady(name)
    yield Step(rng.randint(0, 9000), x, mask, maybe(torch.randint(0, batch, (batch,), generator=generator)),
               rng.randint(0, 2**40), tuple(PushTarget(name, f"s{i}") for i in range(rng.randint(0, 3))), prompts)
    yield StepOutput(x, rng.randint(0, 2**40))
    yield CloseSession()
    yield ForwardRequest(name, start, end, x, mask, prompts, rng.choice(sorted(CODECS)))
    yield PushStep(name, Step(rng.randint(0, 100), x))
    yield ErrorFrame(rng.choice(list(ErrorCode)), name)
    yield ServerInfo(name, start, end, "online", "0.1.0", "float32", rng.randint(0, 10**9), rng.randint(0, 99))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_valid_frames_are_never_refused():
    """The other half of fuzzing: a decoder that refused good frames would pass the tests above."""
    rng = random.Random(4)
    for _ in range(300):
        for message in _random_valid_messages(rng):
            decoded = decode_message(unpack(pack(message.to_wire())), *ALL_TYPES)
            assert _same(decoded, message), (message, decoded)
