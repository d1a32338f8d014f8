"""bloompeer: run BLOOM language models collaboratively over libp2p.

    from bloompeer import DistributedBloomForCausalLM
    model = DistributedBloomForCausalLM.from_pretrained("bigscience/bloom-560m", initial_peers=[...])
"""

from ._version import __version__
from .p2p.errors import (
    BloompeerError, ErrorCode, PeerBusyError, PeerUnavailableError, ProtocolError, RemoteError,
)
from .p2p.node import NetworkConfig, NetworkError
from .peer.client.config import ClientConfig
from .peer.client.errors import MissingBlocksError
from .peer.client.base import DistributedBloomModel
from .peer.client.classification import DistributedBloomForSequenceClassification
from .peer.client.model import DistributedBloomForCausalLM

__all__ = [
    "__version__", "BloompeerError", "ClientConfig", "DistributedBloomForCausalLM",
    "DistributedBloomForSequenceClassification", "DistributedBloomModel",
    "ErrorCode", "MissingBlocksError", "NetworkConfig", "NetworkError", "PeerBusyError", "PeerUnavailableError",
    "ProtocolError", "RemoteError",
]
