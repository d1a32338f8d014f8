"""hivemind's networking loads without hivemind's package init; any name of that init runs it on
first use. Each case runs in a fresh interpreter: this test process has imported hivemind already."""

import subprocess
import sys
import textwrap


def _run(code: str) -> None:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_bloompeers_network_modules_load_without_the_package_init():
    _run("""
        import sys
        from bloompeer.p2p import node, streams, dht  # everything of bloompeer's that imports hivemind
        from hivemind.p2p import P2P
        from hivemind.dht.node import DHTNode
        assert P2P.create and DHTNode.create
        for skipped in ("hivemind.averaging", "hivemind.moe", "hivemind.optim", "scipy"):
            assert skipped not in sys.modules, skipped
    """)


def test_a_name_of_the_package_init_runs_it_on_first_use():
    _run("""
        import sys, types
        import bloompeer.p2p.node
        import hivemind
        assert "hivemind.averaging" not in sys.modules
        assert hivemind.__version__ == "1.1.12"
        assert "hivemind.averaging" in sys.modules and type(hivemind) is types.ModuleType
        from hivemind import DHT, Optimizer
        from hivemind.dht import DHT as dht_class
        assert DHT is dht_class and hivemind.p2p.P2P is bloompeer.p2p.node.P2P
        try:
            hivemind.no_such_name
        except AttributeError:
            pass
        else:
            raise AssertionError("a name the package does not have was found")
    """)


def test_threads_asking_at_once_all_get_the_name():
    _run("""
        import threading
        import bloompeer.p2p
        import hivemind
        start, found, errors = threading.Barrier(4), [], []
        def ask():
            start.wait()
            try:
                found.append(hivemind.DecentralizedAverager)
            except Exception as exc:
                errors.append(exc)
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads: thread.start()
        for thread in threads: thread.join()
        assert not errors and len(found) == 4 and len(set(found)) == 1, (errors, found)
    """)


def test_a_hivemind_imported_before_is_left_as_it_is():
    _run("""
        import types
        import hivemind
        import bloompeer.p2p.node
        assert type(hivemind) is types.ModuleType and hivemind.DHT
    """)
