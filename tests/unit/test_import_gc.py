"""The collector is paused for heavy imports and what they made is frozen, without leaking the
pause: the state before the block is what the process has after it."""

import gc
import weakref

import pytest

from bloompeer.peer.cli.import_gc import imports_without_gc


@pytest.fixture
def collector_restored():
    """Undo the test's freeze and collector changes, so the rest of the test process is unaffected."""
    enabled = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if enabled else gc.disable)()


class _Cycle:
    def __init__(self):
        self.me = self


def test_collector_paused_inside_and_enabled_after(collector_restored):
    gc.enable()
    with imports_without_gc():
        assert not gc.isenabled()
        with imports_without_gc():  # nested: the inner block's end does not resume the outer's pause
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off(collector_restored):
    gc.disable()
    with imports_without_gc():
        pass
    assert not gc.isenabled()


def test_what_the_block_made_is_frozen(collector_restored):
    with imports_without_gc():
        made = [_Cycle() for _ in range(100)]
    refs = [weakref.ref(cycle) for cycle in made]
    del made
    gc.collect()
    assert all(ref() is not None for ref in refs)  # frozen: no collection walks them
    gc.unfreeze()
    gc.collect()
    assert all(ref() is None for ref in refs)  # ... until they are unfrozen


def test_frozen_and_resumed_even_when_the_block_raises(collector_restored):
    gc.enable()
    frozen_before = gc.get_freeze_count()
    with pytest.raises(ImportError), imports_without_gc():
        kept = _Cycle()
        raise ImportError("no such module")
    assert gc.isenabled() and gc.get_freeze_count() > frozen_before and kept.me is kept
