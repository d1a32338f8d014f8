"""The ban list: a failing server is avoided for a while, twice as long each time it fails again
(up to a cap), and used again once its ban is over."""

import pytest

from bloompeer.peer.client import health
from bloompeer.peer.client.health import BanList


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(health.time, "monotonic", clock)
    return clock


def test_a_ban_ends(clock):
    bans = BanList(first_ban_s=5.0)
    bans.ban("a", "lost stream")
    assert bans.banned() == {"a"}
    clock.now += 4.9
    assert bans.banned() == {"a"}
    clock.now += 0.2
    assert bans.banned() == set()


def test_each_failure_doubles_the_ban_up_to_the_cap(clock):
    bans = BanList(first_ban_s=5.0, max_ban_s=12.0)
    lengths = []
    for _ in range(4):
        bans.ban("a", "timeout")
        started = clock.now
        while bans.banned():
            clock.now += 0.5
        lengths.append(clock.now - started)
    assert lengths == [5.0, 10.0, 12.0, 12.0]  # 5, 10, then capped at 12


def test_servers_are_banned_apart_and_a_given_duration_wins(clock):
    bans = BanList(first_ban_s=5.0)
    bans.ban("a", "busy")
    bans.ban("liar", "caught lying", duration_s=3600.0)
    clock.now += 10
    assert bans.banned() == {"liar"}
    bans.ban("liar", "a short ban does not shorten a long one", duration_s=1.0)
    clock.now += 100
    assert bans.banned() == {"liar"}
    bans.ban("a", "again")  # its second failure: 10 s
    clock.now += 9
    assert bans.banned() == {"a", "liar"}
