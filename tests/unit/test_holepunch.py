"""The second chance for hole punching (p2p/holepunch.py), against a stand-in for the daemon."""

from types import SimpleNamespace

from hivemind.p2p import PeerID

from bloompeer.p2p import second_chance

SERVER = "12D3KooWMeD1uz7bKumjkShHmtsRLmd95WnuArwVvTgmC4cdxWaD"
CIRCUIT = "/ip6/3fff:99::a/tcp/1/p2p/12D3KooWQtvKn1LbSjLYR77G8EkpjPP3V9eVVuaMokVog3sJj2dz/p2p-circuit"


class _Daemon:
    """What second_chance asks of hivemind's P2P: our addresses, our connections, a disconnect."""

    def __init__(self, own: list[str], paths: list[str]):
        self.own, self.paths, self.disconnected = own, paths, []
        self._client = SimpleNamespace(disconnect=self._disconnect)

    async def get_visible_maddrs(self, latest: bool = False):
        return self.own

    async def list_peers(self):
        return [SimpleNamespace(peer_id=PeerID.from_base58(SERVER), addrs=[path]) for path in self.paths]

    async def _disconnect(self, peer_id):
        self.disconnected.append(peer_id.to_base58())
        self.paths = []


async def test_a_relayed_connection_is_closed_once_when_we_have_a_public_address():
    daemon = _Daemon(["/ip6/::1/tcp/5", "/ip6/3fff:99::4/tcp/5"], [CIRCUIT])
    await second_chance(daemon, SERVER)
    daemon.paths = [CIRCUIT]  # the session's stream opened a new relayed connection
    await second_chance(daemon, SERVER)
    assert daemon.disconnected == [SERVER]


async def test_nothing_is_closed_without_a_public_address_or_with_a_direct_path():
    for own in (["/ip4/127.0.0.1/tcp/5"], ["/ip4/203.0.113.4/tcp/5", "/ip4/192.168.3.2/tcp/5"]):
        daemon = _Daemon(own, [CIRCUIT])
        await second_chance(daemon, SERVER)
        assert daemon.disconnected == []
    direct = _Daemon(["/ip6/3fff:99::4/tcp/5"], [CIRCUIT, "/ip6/3fff:99::2/tcp/7"])
    await second_chance(direct, SERVER)
    assert direct.disconnected == []
