"""Frames on a libp2p stream: an 8-byte big-endian length, then one msgpack map.

This is the framing of hivemind's `P2P.send_raw_data`, but the length is checked against a
limit before the body is read, and decoding is strict: no ext types (so nothing a peer sends is
ever turned into an object other than plain data), string map keys only, bounded sizes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError

__all__ = ["HEADER_BYTES", "DEFAULT_MAX_FRAME_BYTES", "pack", "unpack", "read_frame", "write_frame"]

HEADER_BYTES = 8
DEFAULT_MAX_FRAME_BYTES = 256 << 20  # a 512-token prefill of BLOOM-176B (hidden 14336) in fp32 is 29 MiB


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(payload: bytes) -> dict[str, Any]:
    """Decode one frame body into a dict with str keys, refusing anything else."""
    try:
        message = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True,
            max_ext_len=0, max_str_len=len(payload), max_bin_len=len(payload),
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"a frame must be a map, got {type(message).__name__}")
    return message


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame. Raises asyncio.IncompleteReadError at end of stream, ProtocolError on bad data.

    A frame over `max_bytes` is refused before its body is read, so the stream is then out of
    sync and the caller must close it after sending the error.
    """
    header = await reader.readexactly(HEADER_BYTES)
    length = int.from_bytes(header, "big")
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes}", ErrorCode.TOO_LARGE)
    return unpack(await reader.readexactly(length))


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    payload = pack(message)
    writer.write(len(payload).to_bytes(HEADER_BYTES, "big") + payload)  # one write: one packet when small
    await writer.drain()
