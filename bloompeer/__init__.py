"""bloompeer: run large language models (BLOOM, Llama, Mistral, Qwen2, Qwen3) collaboratively over libp2p.

    from bloompeer import AutoDistributedModelForCausalLM
    model = AutoDistributedModelForCausalLM.from_pretrained("Qwen/Qwen3-0.6B", initial_peers=[...])

The public names load on first use (see _lazy.py).
"""

from . import _openmp  # noqa: F401  (first: it sets what OpenMP reads as torch loads)
from ._lazy import lazy_attributes
from ._version import __version__
from .errors import BloompeerError

_LAZY = {
    "AutoDistributedModelForCausalLM": ".peer.client.auto",
    "AutoDistributedModelForSequenceClassification": ".peer.client.auto",
    "ClientConfig": ".peer.client.config",
    "DistributedBloomForCausalLM": ".peer.client.families",
    "DistributedBloomForSequenceClassification": ".peer.client.families",
    "DistributedBloomModel": ".peer.client.families",
    "DistributedLlamaForCausalLM": ".peer.client.families",
    "DistributedLlamaForSequenceClassification": ".peer.client.families",
    "DistributedLlamaModel": ".peer.client.families",
    "DistributedQwen3NextForCausalLM": ".peer.client.families",
    "DistributedQwen3NextForSequenceClassification": ".peer.client.families",
    "DistributedQwen3NextModel": ".peer.client.families",
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
