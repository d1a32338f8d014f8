"""A small internet inside Linux network namespaces, for testing peers behind NAT (root only).

    public   10.99.0.10     on the "internet" bridge: bootstrap peer (relay) and a direct server
    router-a 10.99.0.2      masquerades 192.168.1.0/24 (home-a: 192.168.1.2), no port forwarding
    router-b 10.99.0.3      masquerades 192.168.2.0/24 (home-b: 192.168.2.2), no port forwarding

Routers accept from the internet only packets of connections opened from inside (ESTABLISHED),
as a home router does. Every address is assigned here; no packet leaves these namespaces.
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
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    created: list[str] = field(default_factory=list)

    PUBLIC_IP = "10.99.0.10"

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
        self.in_ns(role, "ip", "addr", "add", cidr, "dev", interface)

    def create(self) -> NatTopology:
        try:
            for role in ("inet", "public", "router-a", "home-a", "router-b", "home-b"):
                self._add_ns(role)
            self.in_ns("inet", "ip", "link", "add", "br0", "type", "bridge")
            self.in_ns("inet", "ip", "link", "set", "br0", "up")
            for role, interface, ip in [("public", "eth0", self.PUBLIC_IP), ("router-a", "wan", "10.99.0.2"),
                                        ("router-b", "wan", "10.99.0.3")]:
                port = f"p{role[-1]}"
                self._link(role, interface, "inet", port)
                self.in_ns("inet", "ip", "link", "set", port, "master", "br0")
                self._addr(role, interface, f"{ip}/24")
            for home, router, subnet in [("home-a", "router-a", "192.168.1"), ("home-b", "router-b", "192.168.2")]:
                self._link(router, "lan", home, "eth0")
                self._addr(router, "lan", f"{subnet}.1/24")
                self._addr(home, "eth0", f"{subnet}.2/24")
                self.in_ns(home, "ip", "route", "add", "default", "via", f"{subnet}.1")
                self.in_ns(router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
                self.in_ns(router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
                self.in_ns(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack",
                           "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
                self.in_ns(router, "iptables", "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")
        except BaseException:
            self.delete()
            raise
        return self

    def delete(self) -> None:
        for name in reversed(self.created):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self.created.clear()

    def __enter__(self) -> NatTopology:
        return self.create()

    def __exit__(self, *exc_info) -> None:
        self.delete()
