"""A peer command that has finished exits, whatever is left behind it: past EXIT_DEADLINE_S the
process dumps every thread's stack and exits 1 (a stuck thread would otherwise keep it alive, as
the interpreter joins its non-daemon threads at exit)."""

import subprocess
import sys

SCRIPT = """
import sys, threading
from bloompeer.peer.cli import running_peer
# stuck: the deadline must end the process; clean: a deadline no interpreter exit comes near, even on
# a loaded machine (0.5 s would time the exit itself)
running_peer.EXIT_DEADLINE_S = 0.5 if sys.argv[1] == "stuck" else 120.0

async def command():
    if sys.argv[1] == "stuck":
        threading.Thread(target=threading.Event().wait, name="stuck").start()  # not a daemon thread
    return 3

raise SystemExit(running_peer.run_until_done(command()))
"""


def _run(case: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, timeout=300)


def test_a_stuck_thread_cannot_keep_a_finished_peer_alive():
    result = _run("stuck")
    assert result.returncode == 1, result.stderr
    assert "Timeout (0:00:00.500000)!" in result.stderr and "in wait" in result.stderr, result.stderr


def test_a_peer_that_ends_cleanly_exits_with_its_own_code():
    result = _run("clean")
    assert result.returncode == 3, result.stderr
    assert "Timeout" not in result.stderr
