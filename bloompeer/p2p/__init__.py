"""How bytes travel: msgpack frames and tensors on libp2p streams, DHT records, peer input checks.

Nothing here knows about torch modules or the model's blocks (that is `blocks/`), nor about
serving or routing (that is `peer/`).
"""

from .dht import BlockDirectory, get_dht_time
from .errors import (
    BloompeerError, ErrorCode, PeerBusyError, PeerRefusedError, PeerUnavailableError, ProtocolError, RemoteError,
    remote_error,
)
from .framing import DEFAULT_MAX_FRAME_BYTES, pack, read_frame, unpack, write_frame
from .codecs import CODECS
from .messages import (
    BACKWARD_PROTOCOL, FORWARD_PROTOCOL, INFERENCE_PROTOCOL, INFO_PROTOCOL, PUSH_PROTOCOL, BackwardRequest,
    CloseSession, ErrorFrame, ForwardRequest, Gradients, Message, OpenSession, PushStep, PushTarget, ServerInfo,
    SessionReady, Step, StepOutput, decode_message,
)
from .node import NetworkConfig, NetworkError, PeerNode
from .reachability import reachable_maddrs
from .records import RequestLimits, ServerRecord, ServerState, block_key
from .tensors import FLOAT_DTYPES, WIRE_DTYPES, dtype_name, tensor_from_wire, tensor_to_wire
