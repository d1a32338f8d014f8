"""Is a peer directly reachable? It asks a peer of the swarm to dial it back.

The helper opens plain TCP connections to the addresses the peer lists, but only to those on the
IP address the helper sees the request coming from: a peer can learn whether *its own* address is
open, and cannot turn helpers into scanners of other hosts.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from .errors import ProtocolError
from .framing import read_frame, write_frame
from .messages import DIALBACK_PROTOCOL, DialbackRequest, DialbackResult, ErrorFrame, decode_message

__all__ = ["serve_dialback", "reachable_maddrs"]

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0
MAX_REQUEST_BYTES = 16 << 10


def _ip_and_tcp_port(maddr: str) -> tuple[str, int] | None:
    parts = str(maddr).split("/")
    if len(parts) < 5 or parts[1] not in ("ip4", "ip6") or parts[3] != "tcp" or "p2p-circuit" in parts:
        return None
    try:
        return str(ipaddress.ip_address(parts[2])), int(parts[4])
    except ValueError:
        return None


async def _accepts_tcp(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def _handle_dialback(info: StreamInfo, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request = decode_message(await read_frame(reader, MAX_REQUEST_BYTES), DialbackRequest)
        seen_from = _ip_and_tcp_port(str(info.addr))
        candidates = [m for m in request.maddrs if seen_from and (target := _ip_and_tcp_port(m))
                      and target[0] == seen_from[0]]
        results = await asyncio.gather(*(_accepts_tcp(*_ip_and_tcp_port(m)) for m in candidates))
        await write_frame(writer, DialbackResult(tuple(m for m, ok in zip(candidates, results) if ok)).to_wire())
    except ProtocolError as exc:
        await write_frame(writer, ErrorFrame(exc.code, str(exc)).to_wire())
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve_dialback(p2p: P2P) -> None:
    """Answer other peers' reachability checks."""
    await p2p.add_binary_stream_handler(DIALBACK_PROTOCOL, _handle_dialback)


async def reachable_maddrs(p2p: P2P, helpers: list[str], maddrs: list[str]) -> tuple[list[str], str | None]:
    """(the maddrs a helper could dial, the helper's peer id); ([], None) if no helper answered."""
    for helper in helpers:
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(helper), DIALBACK_PROTOCOL), DIAL_TIMEOUT_S)
            try:
                await write_frame(writer, DialbackRequest(tuple(maddrs[:8])).to_wire())
                reply = decode_message(await asyncio.wait_for(read_frame(reader), 4 * DIAL_TIMEOUT_S),
                                       DialbackResult, ErrorFrame)
            finally:
                writer.close()
        except (P2PDaemonError, ConnectionError, asyncio.TimeoutError, asyncio.IncompleteReadError,
                ProtocolError, ValueError) as exc:
            logger.debug("Reachability check through %s failed: %r", helper, exc)
            continue
        if isinstance(reply, DialbackResult):
            return list(reply.reachable), helper
    return [], None
