"""bloompeer: run BLOOM language models collaboratively over libp2p.

    from bloompeer import DistributedBloomForCausalLM
    model = DistributedBloomForCausalLM.from_pretrained("bigscience/bloom-560m", initial_peers=[...])

The public names load on first use (see _lazy.py).
"""

from ._lazy import lazy_attributes
from ._version import __version__
from .errors import BloompeerError

_LAZY = {
    "ClientConfig": ".peer.client.config",
    "DistributedBloomForCausalLM": ".peer.client.model",
    "DistributedBloomForSequenceClassification": ".peer.client.classification",
    "DistributedBloomModel": ".peer.client.base",
    "ErrorCode": ".p2p.errors",
    "MissingBlocksError": ".peer.client.errors",
    "NetworkConfig": ".p2p.node",
    "NetworkError": ".p2p.node",
    "PeerBusyError": ".p2p.errors",
    "PeerUnavailableError": ".p2p.errors",
    "ProtocolError": ".p2p.errors",
    "RemoteError": ".p2p.errors",
}

__all__ = ["__version__", "BloompeerError", *_LAZY]

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
