"""Importing bloompeer sets libgomp's spin count before torch loads (bloompeer/_openmp.py says why),
and keeps a user's own."""

import os
import subprocess
import sys

from bloompeer._openmp import SPIN_COUNT

PROBE = "import bloompeer, os, torch; print(os.environ.get('GOMP_SPINCOUNT'))"


def _spin_count_seen(**env: str) -> str:
    base = {key: value for key, value in os.environ.items() if key != "GOMP_SPINCOUNT"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=base | env, capture_output=True, text=True, timeout=120,
                          check=True)
    return done.stdout.strip()


def test_importing_bloompeer_sets_the_spin_count_before_torch_loads():
    assert _spin_count_seen() == SPIN_COUNT


def test_a_users_own_spin_count_is_kept():
    assert _spin_count_seen(GOMP_SPINCOUNT="300000") == "300000"
