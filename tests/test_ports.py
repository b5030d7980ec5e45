"""The ports Miles gives the servers it starts: free, and never from the range the kernel hands out to outgoing
connections (where another process's next connection could take the port before the server binds it)."""

import random
import socket

from miles import ports
from miles.ports import free_port


def _outgoing_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    return low, high


def test_a_port_is_free_and_outside_the_outgoing_range_and_not_handed_out_twice():
    low, high = _outgoing_range()
    picked = [free_port() for _ in range(100)]
    assert len(set(picked)) == len(picked)
    assert all(20_000 <= p < low for p in picked), (low, sorted(picked)[:3], sorted(picked)[-3:])
    for port in picked[:10]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises were it taken


def test_a_port_something_listens_on_is_never_picked(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        choices = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])

        class Scripted(random.Random):
            def randrange(self, *args):
                return next(choices)

        monkeypatch.setattr(ports, "_RANDOM", Scripted())
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 65_536)  # so that the listener's port is in range
        assert free_port() != busy


def test_a_seeded_global_random_does_not_make_processes_pick_alike():
    picks = []
    for _ in range(3):  # as three processes would, each seeding the global random alike
        ports._RECENT.clear()
        random.seed(0)
        picks.append(free_port())
    assert len(set(picks)) > 1, picks  # all three alike by chance: about 1 in 10^8
