"""p2p/maddrs.py: the multiaddrs peers tell each other are refused with a ProtocolError unless
they have the shapes bloompeer uses, whatever characters they hold."""

import pytest

from bloompeer.p2p import ProtocolError
from bloompeer.p2p.maddrs import check_circuit_maddr, check_peer_maddr, check_plain_maddr

PEER = "12D3KooW" + "A" * 44
BAD_PORTS = ["0", "65536", "99999", "-1", "+80", " 80", "1_000", "0x50", "²", "٣", "", "8" * 400]


@pytest.mark.parametrize("maddr", [
    f"/ip4/203.0.113.5/tcp/31337/p2p/{PEER}", f"/ip6/::1/tcp/1/p2p/{PEER}", f"/dns4/a.example/tcp/65535/p2p/{PEER}",
    f"/ip4/203.0.113.5/udp/4001/quic-v1/p2p/{PEER}",
])
def test_peer_maddrs(maddr):
    assert check_peer_maddr(maddr) == maddr
    assert check_circuit_maddr(f"{maddr}/p2p-circuit") == f"{maddr}/p2p-circuit"


@pytest.mark.parametrize("port", BAD_PORTS)
def test_a_port_is_a_decimal_number_from_1_to_65535(port):
    for maddr in (f"/ip4/203.0.113.5/tcp/{port}/p2p/{PEER}", f"/ip4/203.0.113.5/udp/{port}/quic-v1/p2p/{PEER}"):
        with pytest.raises(ProtocolError):
            check_peer_maddr(maddr)
    with pytest.raises(ProtocolError):
        check_plain_maddr(f"/ip4/203.0.113.5/tcp/{port}")


@pytest.mark.parametrize("host", ["fe80::1%eth0", "::1%$(reboot)", "::1%a b\n"])
def test_an_ipv6_zone_is_refused(host):
    """A zone means something on its sender's machine only, and may hold any character."""
    with pytest.raises(ProtocolError):
        check_peer_maddr(f"/ip6/{host}/tcp/1/p2p/{PEER}")
    with pytest.raises(ProtocolError):
        check_plain_maddr(f"/ip6/{host}/tcp/1")


@pytest.mark.parametrize("maddr", ["/ip4/10.0.0.1/tcp/4000", "/ip6/::1/tcp/4000", "/ip4/10.0.0.1/udp/4001/quic-v1",
                                   "/dns/a.example/tcp/1"])
def test_plain_maddrs_are_a_host_and_a_port(maddr):
    assert check_plain_maddr(maddr) == maddr


@pytest.mark.parametrize("maddr", [
    "/ip4/10.0.0.1/tcp/4000/", f"/ip4/10.0.0.1/tcp/4000/p2p/{PEER}", "/ip4/10.0.0.1/tcp/4000/ws",
    "/ip4/10.0.0.1/udp/4001", "/ip4/10.0.0.1", "/ip4/10.0.0.256/tcp/1", "/unix/tmp/x", "ip4/10.0.0.1/tcp/1", "", 7,
    None, "/ip4/10.0.0.1/tcp/1" + "/" * 300,
])
def test_anything_else_is_no_plain_maddr(maddr):
    with pytest.raises(ProtocolError):
        check_plain_maddr(maddr)
