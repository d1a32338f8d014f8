"""A hostile or careless peer, speaking raw frames to a real server: every bad request gets an
error frame with a stable code, and the server goes on serving."""

import asyncio

import pytest
import pytest_asyncio
import torch

from bloompeer.p2p import (
    CloseSession, ErrorCode, OpenSession, ProtocolError, Step, decode_message, pack, read_frame, tensor_to_wire,
    unpack, write_frame,
)
from tests.wire import raw_stream

HIDDEN = 64  # the tiny checkpoint's hidden size


@pytest_asyncio.fixture
async def stream(swarm, node):
    reader, writer = await raw_stream(node, swarm.servers[0])  # serves blocks 0:2 of tiny-bloom*
    try:
        yield reader, writer
    finally:
        writer.close()


async def _ask(stream, frame: dict) -> dict:
    reader, writer = stream
    await write_frame(writer, frame)
    return await asyncio.wait_for(read_frame(reader), 30)


def _model_uid(swarm) -> str:
    return swarm.servers[0].stdout[-1].split()[2]  # "online: serving <uid> blocks ..."


def _open(swarm, **changes):
    return {**OpenSession(_model_uid(swarm), 0, 2, 1, 16).to_wire(), **changes}


def _step(position=0, hidden=None, **changes):
    """A step frame; `hidden` may be a tensor or an already encoded (possibly forged) wire map."""
    hidden = torch.randn(1, 1, HIDDEN) if hidden is None else hidden
    wire_hidden = hidden if isinstance(hidden, dict) else tensor_to_wire(hidden)
    return {**Step(position, torch.zeros(1, 1, HIDDEN)).to_wire(), "hidden": wire_hidden, **changes}


async def test_bad_requests_get_error_frames_and_the_stream_lives_on(stream, swarm):
    cases = [
        ({"type": "hello"}, ErrorCode.BAD_REQUEST),
        ({"type": "open", "model": 1}, ErrorCode.BAD_REQUEST),
        (_step(), ErrorCode.BAD_REQUEST),  # before open
        (_open(swarm, model="another-model"), ErrorCode.NOT_SERVING),
        (_open(swarm, end=3), ErrorCode.NOT_SERVING),  # the server holds 0:2 only
        (_open(swarm, max_length=1 << 40), ErrorCode.TOO_LARGE),
        (_open(swarm, batch=1 << 20), ErrorCode.TOO_LARGE),
    ]
    for frame, code in cases:
        reply = await _ask(stream, frame)
        assert (reply["type"], reply["code"]) == ("error", code.value), frame
    assert (await _ask(stream, _open(swarm)))["type"] == "ready"
    session_cases = [
        (_step(hidden=torch.randn(1, 1, HIDDEN + 1)), ErrorCode.BAD_REQUEST),  # wrong hidden size
        (_step(hidden=torch.randn(2, 1, HIDDEN)), ErrorCode.BAD_REQUEST),  # wrong batch
        (_step(position=5), ErrorCode.BAD_REQUEST),  # past the cached tokens
        (_step(hidden=torch.randn(1, 17, HIDDEN)), ErrorCode.TOO_LARGE),  # over max_length
        (_step(hidden={**tensor_to_wire(torch.randn(1, 1, HIDDEN)), "shape": [1, 2, HIDDEN]}),
         ErrorCode.BAD_REQUEST),  # bytes that do not match the shape
        (_step(hypo_ids=tensor_to_wire(torch.tensor([3]))), ErrorCode.BAD_REQUEST),
        (_open(swarm), ErrorCode.BAD_REQUEST),  # a second open on the same stream
    ]
    for frame, code in session_cases:
        reply = await _ask(stream, frame)
        assert (reply["type"], reply["code"]) == ("error", code.value), frame
    reply = await _ask(stream, _step())
    assert reply["type"] == "output"


async def test_an_oversized_frame_is_refused_unread(stream):
    reader, writer = stream
    writer.write((1 << 40).to_bytes(8, "big"))  # announces 1 TiB
    await writer.drain()
    reply = await asyncio.wait_for(read_frame(reader), 30)
    assert reply["code"] == ErrorCode.TOO_LARGE.value
    with pytest.raises(asyncio.IncompleteReadError):  # and the server ended the stream
        await asyncio.wait_for(read_frame(reader), 30)


async def test_undecodable_bytes_get_an_error_frame(stream):
    reader, writer = stream
    payload = b"\xc1\xc1\xc1"
    writer.write(len(payload).to_bytes(8, "big") + payload)
    await writer.drain()
    assert (await asyncio.wait_for(read_frame(reader), 30))["code"] == ErrorCode.BAD_REQUEST.value
    ext = pack({"x": 1})[:-1] + b"\xd4\x05\x00"  # an ext type where a value belongs
    writer.write(len(ext).to_bytes(8, "big") + ext)
    await writer.drain()
    assert (await asyncio.wait_for(read_frame(reader), 30))["code"] == ErrorCode.BAD_REQUEST.value


@torch.inference_mode()
def test_the_server_still_serves_after_all_that(model, reference_model):
    ids = torch.tensor([[5, 6, 7]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).tolist() == \
        reference_model.generate(ids, max_new_tokens=4, do_sample=False).tolist()


async def test_a_stream_of_fuzzed_frames_gets_answers_not_crashes(stream, swarm):
    """Mutations of valid frames, one after another on one stream: every one is answered, with an
    error frame or (when the mutation happens to be valid) a normal reply."""
    import random

    from tests.unit.test_fuzz_decoding import _mutate_bytes, _mutate_structure

    rng = random.Random(4)
    seeds = [_open(swarm), _step()]
    reader, writer = stream
    for _ in range(150):
        seed = rng.choice(seeds)
        if rng.random() < 0.5:
            payload = pack(_mutate_structure(seed, rng))
        else:
            payload = _mutate_bytes(pack(seed), rng)
        if _is_a_valid_close(payload):
            continue  # the server would rightly end the stream
        writer.write(len(payload).to_bytes(8, "big") + payload)
        await writer.drain()
        reply = await asyncio.wait_for(read_frame(reader), 30)
        assert reply["type"] in {"error", "ready", "output"}, reply


def _is_a_valid_close(payload: bytes) -> bool:
    try:
        return isinstance(decode_message(unpack(payload), CloseSession), CloseSession)
    except ProtocolError:
        return False
