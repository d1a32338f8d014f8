"""How bytes travel: msgpack frames and tensors on libp2p streams, DHT records, peer input checks.

Nothing here knows about torch modules or the model's blocks (that is `blocks/`), nor about
serving or routing (that is `peer/`).

Names load on first use (PEP 562), so that light users (the command line's flags, configs)
import no hivemind or torch.

hivemind itself loads without its package init (see hivemind_package.py): installed here, before
any module of this package imports hivemind.
"""

from .._lazy import lazy_attributes
from .hivemind_package import install as _install_hivemind_package

_install_hivemind_package()

_LAZY = {
    "BACKWARD_PROTOCOL": ".messages",
    "BackwardRequest": ".messages",
    "BlockDirectory": ".dht",
    "BloompeerError": ".errors",
    "CODECS": ".codecs",
    "CloseSession": ".messages",
    "DEFAULT_MAX_FRAME_BYTES": ".framing",
    "ErrorCode": ".errors",
    "ErrorFrame": ".messages",
    "FLOAT_DTYPES": ".tensors",
    "FORWARD_PROTOCOL": ".messages",
    "FoundRecord": ".dht",
    "ForwardRequest": ".messages",
    "Gradients": ".messages",
    "INFERENCE_PROTOCOL": ".messages",
    "INFO_PROTOCOL": ".messages",
    "IncomingStream": ".streams",
    "Message": ".messages",
    "NetworkConfig": ".network_config",
    "NetworkError": ".node",
    "OpenSession": ".messages",
    "MAX_PUSH_RTTS": ".records",
    "MAX_RTT_S": ".records",
    "P2P": ".streams",
    "PUSH_PROTOCOL": ".messages",
    "PeerBusyError": ".errors",
    "PeerMisbehavedError": ".errors",
    "PeerNode": ".node",
    "PeerRefusedError": ".errors",
    "PeerStream": ".streams",
    "PeerUnavailableError": ".errors",
    "ProtocolError": ".errors",
    "PushStep": ".messages",
    "PushTarget": ".messages",
    "RELAY_SLOTS": ".relays",
    "RelaySlots": ".relays",
    "RemoteError": ".errors",
    "RequestError": ".errors",
    "RequestLimits": ".records",
    "ServerInfo": ".messages",
    "ServerRecord": ".records",
    "ServerState": ".records",
    "SessionReady": ".messages",
    "Step": ".messages",
    "StepOutput": ".messages",
    "StreamHandler": ".streams",
    "WIRE_DTYPES": ".tensors",
    "announceable": ".relays",
    "block_key": ".records",
    "decode_message": ".messages",
    "dtype_name": ".tensors",
    "get_dht_time": ".dht",
    "live_relays": ".relays",
    "pack": ".framing",
    "ping": ".latency",
    "reachable_maddrs": ".reachability",
    "read_frame": ".framing",
    "relays_in_records": ".relays",
    "remote_error": ".errors",
    "request_once": ".streams",
    "second_chance": ".holepunch",
    "serve": ".streams",
    "stop_serving": ".streams",
    "tensor_from_wire": ".tensors",
    "tensor_to_wire": ".tensors",
    "unpack": ".framing",
    "write_frame": ".framing",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
