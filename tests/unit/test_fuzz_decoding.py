"""Seeded fuzzing of the wire decoders: whatever bytes a peer sends, decoding either succeeds or
raises ProtocolError; nothing else escapes (no crash, no other exception type, no hang)."""

import random

import torch

from bloompeer.p2p import (
    CloseSession, ErrorFrame, ForwardRequest, OpenSession, ProtocolError, PushStep, PushTarget, ServerInfo,
    SessionReady, Step, StepOutput, decode_message, pack, unpack,
)
from bloompeer.p2p.records import RequestLimits, ServerRecord, ServerState

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
    seed = ServerRecord("12D3KooW", ServerState.ONLINE, 0, 4, 10.0, 100, "float32", "0.1.0", "abc", False,
                        RequestLimits(64, 8192, 65536)).to_wire()
    for _ in range(2000):
        try:
            ServerRecord.from_wire(_mutate_structure(seed, rng))
        except ProtocolError:
            pass
