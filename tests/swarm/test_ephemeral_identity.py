"""A server started without --identity-path signs with a key made for its process's life, kept in
memory: no file of it outlives a daemon's start (a server killed later, by SIGKILL or the OOM
killer, leaves no private key in the temp directory), and a rejoin (new relays) keeps its peer id."""

from __future__ import annotations

import tempfile

from bloompeer.p2p import NetworkConfig, PeerNode


def _key_files(directory) -> list:
    return [path for path in directory.iterdir() if path.name.startswith("bloompeer-identity-")]


async def test_a_new_identity_leaves_no_key_file_and_keeps_its_peer_id_across_a_rejoin(swarm, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the node's temporary files go
    config = NetworkConfig(initial_peers=tuple(swarm.initial_peers), host_maddrs=("/ip4/127.0.0.1/tcp/0",))
    node = await PeerNode.create(config, announcing=True)
    try:
        peer_id = node.peer_id_str
        assert _key_files(tmp_path) == []
        node = await node.rejoin(config)
        assert node.peer_id_str == peer_id
        assert _key_files(tmp_path) == []
    finally:
        await node.shutdown()
