"""Frames on a libp2p stream: an 8-byte big-endian length, then one msgpack map.

This is the framing of hivemind's `P2P.send_raw_data`, but the length is checked against a
limit before the body is read, and decoding is strict: no ext types (so nothing a peer sends is
ever turned into an object other than plain data), string map keys only, bounded sizes, and a
bounded number of items: msgpack builds one Python object per item, so a frame of one-byte empty
arrays would otherwise cost ~75 bytes of memory per byte received.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError

__all__ = [
    "HEADER_BYTES", "DEFAULT_MAX_FRAME_BYTES", "MAX_FRAME_ITEMS", "pack", "unpack", "read_frame", "read_frame_body",
    "write_frame",
]

HEADER_BYTES = 8
DEFAULT_MAX_FRAME_BYTES = 256 << 20  # a 512-token prefill of BLOOM-176B (hidden 14336) in fp32 is 29 MiB
# containers and their elements in one frame: tensors travel as bytes (one item each), so the largest
# real frames make ~450 (a step with every tensor, pushed along 64 hops; a full server record: ~90)
MAX_FRAME_ITEMS = 4096


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} is not allowed")


class _ItemBudget:
    """Counts the items of one frame as msgpack builds it, and stops the decoding past `limit`.

    msgpack calls the hooks as each array or map is complete, with its elements, and each is at most
    `limit` long (max_array_len, max_map_len): a frame is refused after at most twice `limit` objects
    were built, whatever their nesting.
    """

    def __init__(self, limit: int):
        self.limit = self.left = limit

    def _spend(self, items: int) -> None:
        self.left -= items
        if self.left < 0:
            raise ProtocolError(f"a frame may hold at most {self.limit} items (values, arrays and maps)")

    def array(self, values: list) -> list:
        self._spend(1 + len(values))
        return values

    def map(self, pairs: list[tuple[Any, Any]]) -> dict:
        self._spend(1 + 2 * len(pairs))
        return dict(pairs)


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(payload: bytes) -> dict[str, Any]:
    """Decode one frame body into a dict with str keys, refusing anything else."""
    budget = _ItemBudget(MAX_FRAME_ITEMS)
    try:
        message = msgpack.unpackb(
            payload, raw=False, strict_map_key=True, ext_hook=_refuse_ext, use_list=True,
            max_ext_len=0, max_str_len=len(payload), max_bin_len=len(payload),
            max_array_len=MAX_FRAME_ITEMS, max_map_len=MAX_FRAME_ITEMS,
            list_hook=budget.array, object_pairs_hook=budget.map,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError, ExtraData, FormatError, StackError, ...
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError(f"a frame must be a map, got {type(message).__name__}")
    return message


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> dict[str, Any]:
    """Read one frame. Raises asyncio.IncompleteReadError at end of stream, ProtocolError on bad data."""
    return unpack(await read_frame_body(reader, max_bytes))


async def read_frame_body(reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """One frame's body, still packed (for a reader that notes when its bytes were all in).

    A frame over `max_bytes` is refused before its body is read, so the stream is then out of
    sync and the caller must close it after sending the error.
    """
    header = await reader.readexactly(HEADER_BYTES)
    length = int.from_bytes(header, "big")
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes}", ErrorCode.TOO_LARGE)
    return await reader.readexactly(length)


async def write_frame(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    payload = pack(message)
    writer.write(len(payload).to_bytes(HEADER_BYTES, "big") + payload)  # one write: one packet when small
    await writer.drain()
