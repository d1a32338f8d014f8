"""bloompeer: run BLOOM language models collaboratively over libp2p.

    from bloompeer import DistributedBloomForCausalLM
    model = DistributedBloomForCausalLM.from_pretrained("bigscience/bloom-560m", initial_peers=[...])

The public names load on first use (PEP 562): importing torch, transformers and hivemind takes
seconds, and the command line must answer --help or refuse a bad flag before that.
"""

import importlib

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


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'bloompeer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
