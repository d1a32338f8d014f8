"""The root of bloompeer's error tree. It imports nothing of bloompeer, so every module can extend it.

The class of an error says what its caller should do: give up at once (the request is wrong),
try another server (this one cannot serve it now), or stop trusting the server (it broke the
rules). Everything else is an end state the user reads.

    BloompeerError                        every error bloompeer raises on purpose
    ├── RequestError                      (a) the request can never succeed as asked: raised at once to the
    │   │                                     caller, naming what to change; no server is blamed
    │   ├── RequestTooLargeError  client/     over the limits of every server of some block (the limit, the
    │   │                                     value asked and the `serve` flag that raises it)
    │   ├── CheckpointError       blocks/     not a checkpoint we can read (path, config, shards)
    │   ├── MemoryPlanError       peer/       a server's blocks, cache and overhead would not fit the memory
    │   │                                     available (the figures, the flag to change)
    │   └── IdentityError         p2p/        an identity key file we cannot use
    ├── RemoteError               p2p/    one server failed one request; `.peer` names it, `.code` says how
    │   ├── PeerUnavailableError          (b) this server cannot take it now or failed (not_serving, timeout,
    │   │   │                                 internal, lost stream): route around it and replay
    │   │   ├── PeerBusyError                 busy: no room now; banned briefly, tried again later
    │   │   └── PeerRefusedError              too_large / unsupported: over this server's limits; avoided for
    │   │                                     this request only, never banned
    │   └── PeerMisbehavedError           (c) this server broke the protocol (bad_request for a valid request,
    │                                         an invalid or ill-shaped reply) or was caught lying: ban it
    ├── ProtocolError             p2p/    we refuse what a peer sent (bad frame, bad field, over a limit):
    │                                     `.code` is the error frame we answer with; the client's stream
    │                                     layer turns one in a server's reply into a PeerMisbehavedError
    ├── MissingBlocksError        client/ no usable server for some blocks, even after waiting: start one
    ├── ClientShutDownError       client/ the client is shutting down: new calls are refused, running ones end
    ├── CallCancelledError        client/ the caller cancelled the call from another thread (its client left)
    ├── SessionClosedError        client/ the inference session was closed before, or while, the call ran
    ├── NetworkError              p2p/    this peer could not join the network
    └── ProcessFailed             peer/   a local swarm's peer process exited or stayed silent at start

A caller branches on the class, never on text: the one route/retry loop of the client
(`peer/client/retry.py`) lets RequestError through, re-routes on PeerUnavailableError (banning the
server for a while, or for a PeerRefusedError avoiding it for this request only), and bans on
PeerMisbehavedError. The stable codes of error frames and their mapping to these classes live in
one place, `p2p/errors.py` (`ErrorCode`, `remote_error`).
"""

__all__ = ["BloompeerError", "RequestError"]


class BloompeerError(Exception):
    """Base of every error bloompeer raises on purpose; the CLI prints these as one line, no traceback."""


class RequestError(BloompeerError, ValueError):
    """The request can never succeed as asked: the caller's arguments (or the servers' settings) must
    change. Raised at once, before or instead of trying servers; no server is blamed for it. A
    ValueError too, for callers that treat bad arguments alike."""
