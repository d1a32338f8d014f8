"""Is a peer directly reachable? It asks a peer of the swarm to dial it back.

The helper opens plain TCP connections to the addresses the peer lists, but only to those on the
IP address the helper sees the request coming from: a peer can learn whether *its own* address is
open, and cannot turn helpers into scanners of other hosts. A request must list plain multiaddrs
(host and port, see maddrs.py), else it is refused as bad_request; and the asker believes a helper
only about the addresses it asked about, as those it finds reachable are the ones it announces.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.datastructures import StreamInfo

from .errors import ProtocolError, RemoteError
from .framing import read_frame, write_frame
from .maddrs import MAX_MADDR_CHARS, check_plain_maddr
from .messages import PROTOCOL_VERSION, ErrorFrame, Fields, Message, decode_message
from .streams import PeerStream

__all__ = ["DIALBACK_PROTOCOL", "DialbackRequest", "DialbackResult", "serve_dialback", "reachable_maddrs"]

DIALBACK_PROTOCOL = f"bloompeer.dialback/{PROTOCOL_VERSION}"  # peer: DialbackRequest -> helper: DialbackResult

logger = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 3.0
MAX_REQUEST_BYTES = 16 << 10
MAX_DIALBACK_ADDRS = 8


@dataclass(frozen=True)
class DialbackRequest(Message):
    """Please try to open TCP connections to these multiaddrs of mine (a reachability check)."""

    TYPE: ClassVar[str] = "dialback"
    maddrs: tuple[str, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "maddrs": list(self.maddrs)}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> DialbackRequest:
        f = Fields(message, cls.TYPE, {"maddrs"})
        maddrs = message["maddrs"]
        if not isinstance(maddrs, list) or len(maddrs) > MAX_DIALBACK_ADDRS:
            raise ProtocolError(f"{f.type_name}.maddrs must be a list of at most {MAX_DIALBACK_ADDRS} multiaddrs")
        try:
            return cls(tuple(check_plain_maddr(maddr) for maddr in maddrs))
        except ProtocolError as exc:
            raise ProtocolError(f"{f.type_name}.maddrs: {exc}") from exc


@dataclass(frozen=True)
class DialbackResult(Message):
    TYPE: ClassVar[str] = "dialback_result"
    reachable: tuple[str, ...]  # the requested multiaddrs that accepted a connection

    def to_wire(self) -> dict[str, Any]:
        return {"type": self.TYPE, "reachable": list(self.reachable)}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> DialbackResult:
        Fields(message, cls.TYPE, {"reachable"})
        reachable = message["reachable"]
        if (not isinstance(reachable, list) or len(reachable) > MAX_DIALBACK_ADDRS
                or not all(isinstance(m, str) and len(m) <= MAX_MADDR_CHARS for m in reachable)):
            raise ProtocolError(f"dialback_result.reachable must be at most {MAX_DIALBACK_ADDRS} multiaddr strings")
        return cls(tuple(reachable))


def _plain(maddrs: list[str]) -> list[str]:
    """Those of our addresses a helper can be asked about (another would get the request refused)."""
    plain = []
    for maddr in maddrs:
        try:
            plain.append(check_plain_maddr(maddr))
        except ProtocolError:
            continue
    return plain[:MAX_DIALBACK_ADDRS]


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
    """(the maddrs a helper could dial, the helper's peer id); ([], None) if no helper answered.

    Only plain maddrs are asked about, and of the helper's answer only those asked about are kept.
    """
    request = DialbackRequest(tuple(_plain(maddrs)))
    for helper in helpers:
        try:
            stream = await PeerStream.open(p2p, helper, DIALBACK_PROTOCOL, DIAL_TIMEOUT_S, "reachability check")
            try:
                reply = await stream.request(request, DialbackResult, extra_wait_s=3 * DIAL_TIMEOUT_S)
            finally:
                await stream.close()
        except RemoteError as exc:
            logger.debug("Reachability check through %s failed: %s", helper, exc)
            continue
        return _asked_about(request, reply, helper), helper
    return [], None


def _asked_about(request: DialbackRequest, reply: DialbackResult, helper: str) -> list[str]:
    """The reachable addresses of the request, in its order: a helper cannot make us announce others."""
    others = set(reply.reachable) - set(request.maddrs)
    if others:
        logger.warning("Reachability helper %s named addresses it was not asked about: %s", helper,
                       sorted(map(repr, others))[:MAX_DIALBACK_ADDRS])
    return [maddr for maddr in request.maddrs if maddr in reply.reachable]
