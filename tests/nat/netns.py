"""A small internet inside Linux network namespaces, for testing peers behind NAT (root only).

    public hosts   on the "internet" bridge, 10.99.0.10, .11, ... (and, with `wan6`, an IPv6 address each)
    router-X       its WAN on the bridge (10.99.0.2, .3, ...); masquerades its home's LAN
    home-X         192.168.N.2 behind router-X (and fd00:N::2 with `wan6`), no port forwarding

By default: one public host ("public") and two homes ("a", "b"). Routers accept from the internet
only packets of connections opened from inside (ESTABLISHED, RELATED), as a home router does; over
IPv6 they masquerade too (NAT66), so that a home has no address anyone outside can dial; and they
drop, rather than refuse, unsolicited connections to themselves, as most home routers do. Every
address is assigned here; no packet leaves these namespaces.

`wan4`/`wan6` choose the internet's addresses: the default 10.99.0.0/24 is private, which libp2p
treats as such; a documentation range (203.0.113.0/24, or 3fff:99::/64 from 3fff::/20) looks
public to a person, and to libp2p only where its address filters say so (see docs/nat.md).
"""

from __future__ import annotations

import subprocess
import uuid
from dataclasses import dataclass, field

__all__ = ["NatTopology", "TopologyError"]


class TopologyError(RuntimeError):
    """The kernel or the tools refused to build the namespaces (the reason is in the message)."""


def _run(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise TopologyError(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


@dataclass
class NatTopology:
    public_hosts: tuple[str, ...] = ("public",)
    homes: tuple[str, ...] = ("a", "b")
    wan4: str = "10.99.0"  # the internet's /24
    wan6: str | None = None  # the internet's /64 prefix, e.g. "3fff:99:" (None: IPv4 only)
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    created: list[str] = field(default_factory=list)

    @property
    def PUBLIC_IP(self) -> str:  # noqa: N802 (the first public host's address, as tests name it)
        return self.ip4(self.public_hosts[0])

    def _wan_index(self, role: str) -> int:
        if role in self.public_hosts:
            return 10 + self.public_hosts.index(role)
        if role.startswith("router-") and role[7:] in self.homes:
            return 2 + self.homes.index(role[7:])
        raise KeyError(f"{role} has no address on the internet")

    def ip4(self, role: str) -> str:
        """A public host's or router's IPv4 address on the internet, or a home's own (private) one."""
        if role.startswith("home-"):
            return f"192.168.{1 + self.homes.index(role[5:])}.2"
        return f"{self.wan4}.{self._wan_index(role)}"

    def ip6(self, role: str) -> str:
        if self.wan6 is None:
            raise KeyError("this topology has no IPv6")
        if role.startswith("home-"):
            return f"fd00:{1 + self.homes.index(role[5:])}::2"
        return f"{self.wan6}:{self._wan_index(role):x}"

    def ns(self, role: str) -> str:
        return f"bp{self.tag}-{role}"

    def exec_prefix(self, role: str) -> list[str]:
        """Run a program in a namespace: [*prefix, program, args...]."""
        return ["ip", "netns", "exec", self.ns(role)]

    def in_ns(self, role: str, *args: str) -> str:
        return _run(*self.exec_prefix(role), *args)

    def _add_ns(self, role: str) -> None:
        _run("ip", "netns", "add", self.ns(role))
        self.created.append(self.ns(role))
        self.in_ns(role, "ip", "link", "set", "lo", "up")

    def _link(self, a: str, a_if: str, b: str, b_if: str) -> None:
        """A veth pair between two namespaces (names are per namespace, so they can repeat)."""
        tmp_a, tmp_b = f"v{self.tag}{a_if}"[:15], f"w{self.tag}{b_if}"[:15]
        _run("ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        _run("ip", "link", "set", tmp_a, "netns", self.ns(a))
        _run("ip", "link", "set", tmp_b, "netns", self.ns(b))
        self.in_ns(a, "ip", "link", "set", tmp_a, "name", a_if)
        self.in_ns(b, "ip", "link", "set", tmp_b, "name", b_if)
        self.in_ns(a, "ip", "link", "set", a_if, "up")
        self.in_ns(b, "ip", "link", "set", b_if, "up")

    def _addr(self, role: str, interface: str, cidr: str) -> None:
        ipv6 = ":" in cidr
        self.in_ns(role, "ip", *(["-6"] if ipv6 else []), "addr", "add", cidr, "dev", interface,
                   *(["nodad"] if ipv6 else []))  # no duplicate address detection: usable at once

    def create(self) -> NatTopology:
        try:
            routers = [f"router-{home}" for home in self.homes]
            for role in ("inet", *self.public_hosts, *routers, *(f"home-{home}" for home in self.homes)):
                self._add_ns(role)
            self.in_ns("inet", "ip", "link", "add", "br0", "type", "bridge")
            self.in_ns("inet", "ip", "link", "set", "br0", "up")
            for index, role in enumerate((*self.public_hosts, *routers)):
                interface, port = ("wan" if role in routers else "eth0"), f"p{index}"
                self._link(role, interface, "inet", port)
                self.in_ns("inet", "ip", "link", "set", port, "master", "br0")
                self._addr(role, interface, f"{self.ip4(role)}/24")
                if self.wan6 is not None:
                    self._addr(role, interface, f"{self.ip6(role)}/64")
            for home in self.homes:
                self._add_home(home)
        except BaseException:
            self.delete()
            raise
        return self

    def _add_home(self, home: str) -> None:
        router, host = f"router-{home}", f"home-{home}"
        self._link(router, "lan", host, "eth0")
        subnet = self.ip4(host).rsplit(".", 1)[0]
        self._addr(router, "lan", f"{subnet}.1/24")
        self._addr(host, "eth0", f"{self.ip4(host)}/24")
        self.in_ns(host, "ip", "route", "add", "default", "via", f"{subnet}.1")
        self.in_ns(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        firewalls = ["iptables"]
        if self.wan6 is not None:
            prefix6 = self.ip6(host).rsplit(":", 1)[0]
            self._addr(router, "lan", f"{prefix6}:1/64")
            self._addr(host, "eth0", f"{self.ip6(host)}/64")
            self.in_ns(host, "ip", "-6", "route", "add", "default", "via", f"{prefix6}:1")
            self.in_ns(router, "sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1")
            firewalls.append("ip6tables")
        for tool in firewalls:
            self.in_ns(router, tool, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            self.in_ns(router, tool, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack",
                       "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
            self.in_ns(router, tool, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
            for transport in ("tcp", "udp"):  # unsolicited packets to the router itself: dropped, not refused
                self.in_ns(router, tool, "-A", "INPUT", "-i", "wan", "-p", transport, "-m", "conntrack",
                           "--ctstate", "NEW,INVALID", "-j", "DROP")

    def delete(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def __enter__(self) -> NatTopology:
        return self.create()

    def __exit__(self, *exc_info) -> None:
        self.delete()
