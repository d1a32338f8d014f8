"""The root of bloompeer's error tree. It imports nothing of bloompeer, so every module can extend it.

    BloompeerError                      every error bloompeer raises on purpose
    ├── CheckpointError      blocks/    not a checkpoint we can read (path, config, shards)
    ├── IdentityError        p2p/       an identity key file we cannot use
    ├── NetworkError         p2p/       the peer could not join the network
    ├── ProtocolError        p2p/       a peer sent something we refuse (bad frame, bad field, too large)
    ├── RemoteError          p2p/       a peer answered with an error frame; `.code` says which kind
    │   ├── PeerBusyError                   busy: no room now; try elsewhere or later
    │   ├── PeerRefusedError                too_large: over this peer's limits; avoid it for this request only
    │   └── PeerUnavailableError            not_serving / timeout / lost stream: re-route and replay
    ├── MissingBlocksError   client/    no usable server covers some blocks, even after waiting
    └── RequestTooLargeError client/    over every server's limits: the request can never succeed as asked

What a caller does follows the class: a RequestTooLargeError (or a ValueError for bad arguments)
goes straight back to the user, and no server is blamed; PeerBusyError and PeerUnavailableError
mean "this server, not now": the client bans it for a while and routes around it; a RemoteError
with a protocol code (bad_request, internal) or a caught lie also bans the server. The mapping from
an error frame's code to its class is `p2p.errors.remote_error`, the only place that decides it.
"""

__all__ = ["BloompeerError"]


class BloompeerError(Exception):
    """Base of every error bloompeer raises on purpose; the CLI prints these as one line, no traceback."""
