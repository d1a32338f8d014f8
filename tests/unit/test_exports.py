import bloompeer


def test_public_names_are_pinned():
    assert sorted(bloompeer.__all__) == sorted([
        "__version__", "AutoDistributedModelForCausalLM", "AutoDistributedModelForSequenceClassification",
        "BloompeerError", "ClientConfig", "DistributedBloomForCausalLM",
        "DistributedBloomForSequenceClassification", "DistributedBloomModel", "DistributedLlamaForCausalLM",
        "DistributedLlamaForSequenceClassification", "DistributedLlamaModel", "DistributedQwen3NextForCausalLM",
        "DistributedQwen3NextForSequenceClassification", "DistributedQwen3NextModel",
        "ErrorCode", "MissingBlocksError", "NetworkConfig", "NetworkError", "PeerBusyError", "PeerUnavailableError",
        "ProtocolError", "RemoteError",
    ])
    for name in bloompeer.__all__:
        assert hasattr(bloompeer, name)


def test_importing_changes_nothing_global():
    """Import does nothing to its host: checked in a fresh interpreter, before and after."""
    import subprocess
    import sys

    script = (
        "import logging, multiprocessing as mp, os\n"
        "env, handlers = dict(os.environ), list(logging.getLogger().handlers)\n"
        "import bloompeer\n"
        "assert dict(os.environ) == env, 'environment changed'\n"
        "assert logging.getLogger().handlers == handlers, 'root log handlers changed'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
