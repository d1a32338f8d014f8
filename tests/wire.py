"""Raw wire access for tests that speak the protocol themselves (hostile frames, light clients):
a stream to a server with nothing of the client's checks in between, and a server's info frame."""

from __future__ import annotations

import asyncio

from hivemind.p2p import PeerID

from bloompeer.p2p import INFERENCE_PROTOCOL, INFO_PROTOCOL, PeerNode, ServerInfo, read_frame

__all__ = ["raw_stream", "server_info"]


async def raw_stream(node: PeerNode, server, protocol: str = INFERENCE_PROTOCOL):
    """(reader, writer) of a new stream from `node` to `server` (a PeerProcess) for `protocol`."""
    _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(server.peer_id_str), protocol)
    return reader, writer


async def server_info(node: PeerNode, server, attempts: int = 3) -> ServerInfo:
    """The server's info frame, asked again if the stream ends unanswered (seen now and then on a
    loaded machine, with nothing about it in the servers' logs)."""
    for attempt in range(attempts):
        reader, writer = await raw_stream(node, server, INFO_PROTOCOL)
        try:
            return ServerInfo.from_wire(await asyncio.wait_for(read_frame(reader), 30))
        except (asyncio.IncompleteReadError, ConnectionError):
            if attempt == attempts - 1:
                raise
        finally:
            writer.close()
