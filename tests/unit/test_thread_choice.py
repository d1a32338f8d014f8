"""The server's choice of threads for small inference passes, from the passes' own times.

The passes here take the times the test gives them (a fake clock, or recorded times), never what the
machine's load makes of a sleep; and /proc/stat's idle ticks are the test's own readings."""

import types

from bloompeer.peer.server import thread_choice
from bloompeer.peer.server.thread_choice import RETRY_EVERY, TRY_PASSES, ThreadChoice

ROWS = 8


class _Clock:
    """thread_choice's `time` module, whose perf_counter moves only when a pass says so."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def pass_of(self, seconds: float):
        """A pass that takes `seconds` on this clock."""
        def advance():
            self.now += seconds
        return advance


def _fake_clock(monkeypatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(thread_choice, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    return clock


def _run(choice: ThreadChoice, passes: int, seconds: dict[int, float]) -> list[int]:
    chosen = []
    for _ in range(passes):
        threads = choice.choose(ROWS)
        choice.record(ROWS, threads, seconds[threads])
        chosen.append(threads)
    return chosen


def test_tries_each_count_then_keeps_the_faster_and_tries_the_other_less_often_each_time_it_loses():
    choice = ThreadChoice(max_threads=2)
    chosen = _run(choice, 2 + 8 * RETRY_EVERY, {1: 0.140, 2: 0.120})
    assert chosen[:2] == [1, 2]
    tries = [index for index, threads in enumerate(chosen[2:], start=1) if threads == 1]
    first = RETRY_EVERY
    second = first + TRY_PASSES - 1 + 2 * RETRY_EVERY  # 16 passes, then 32, then 64 after each try's end
    third = second + TRY_PASSES - 1 + 4 * RETRY_EVERY
    assert tries == [*range(first, first + TRY_PASSES), *range(second, second + TRY_PASSES),
                     *range(third, third + TRY_PASSES)]


def test_a_lasting_slowdown_switches_in_three_passes_and_one_winning_try_switches_back():
    choice = ThreadChoice(max_threads=2)
    _run(choice, 4, {1: 0.140, 2: 0.120})
    assert _run(choice, 4, {1: 0.140, 2: 0.390}) == [2, 2, 2, 1]  # the other core got busy: 3 slow passes of 5
    busy = _run(choice, 4 * RETRY_EVERY, {1: 0.140, 2: 2.0})
    assert busy.count(2) == 2  # tried after 16 passes, lost at once (2 s: 14 times slower), then after 32 more
    free = _run(choice, 2 * 4 * RETRY_EVERY, {1: 0.140, 2: 0.120})  # the core is free again
    switched = free.index(2)
    assert switched < 4 * RETRY_EVERY  # the next try (due after 64 passes since the last) wins
    after = free[switched + 1:]
    next_try = TRY_PASSES - 1 + RETRY_EVERY  # after the winning try's other passes, 16 again
    assert [i for i, threads in enumerate(after, start=1) if threads == 1][:TRY_PASSES] == \
        list(range(next_try, next_try + TRY_PASSES))


def test_spikes_on_the_settled_count_do_not_switch_but_a_lasting_slowdown_does():
    choice = ThreadChoice(max_threads=2)
    _run(choice, 4, {1: 0.085, 2: 0.065})  # as a decode step of 14 Qwen3-shape blocks on an idle VM
    assert _run(choice, 2, {1: 0.085, 2: 0.150}) == [2, 2]  # two passes twice as slow as usual
    assert _run(choice, 3, {1: 0.085, 2: 0.065}) == [2, 2, 2]  # the median did not move
    assert _run(choice, 4, {1: 0.085, 2: 0.160})[-1] == 1  # slower pass after pass: left


def test_a_try_is_judged_by_the_median_of_its_passes():
    choice = ThreadChoice(max_threads=2)
    _run(choice, 2, {1: 0.060, 2: 0.080})  # settled on one thread: two looked slower at first
    assert set(_run(choice, RETRY_EVERY - 1, {1: 0.060, 2: 0.050})) == {1}
    times = iter([0.083, 0.050, 0.049])  # the try of two threads, one noisy pass of three
    for _ in range(TRY_PASSES):
        threads = choice.choose(ROWS)
        assert threads == 2
        choice.record(ROWS, threads, next(times))
    assert choice.choose(ROWS) == 2


def test_more_threads_are_tried_only_while_the_other_cores_look_free():
    choice = ThreadChoice(max_threads=2)
    choice.others_free = False
    assert _run(choice, 3 * RETRY_EVERY, {1: 0.140, 2: 0.120}) == [1] * (3 * RETRY_EVERY)  # not even a first try
    choice.others_free = True
    assert _run(choice, 3, {1: 0.140, 2: 0.120}) == [2, 2, 2]  # the first try, due long ago, wins


def test_sizes_are_measured_apart_and_one_core_means_one_thread():
    choice = ThreadChoice(max_threads=2)
    _run(choice, 4, {1: 0.140, 2: 0.120})
    assert choice.choose(64) == 1  # 64 rows: not measured yet
    single = ThreadChoice(max_threads=1)
    assert {single.choose(ROWS) for _ in range(3 * RETRY_EVERY)} == {1}


def _threads_of_this_thread() -> int:
    import torch

    return torch.get_num_threads()


async def test_the_compute_thread_measures_batched_passes_and_single_requests_apart(compute, monkeypatch):
    import torch

    # no /proc/stat: a pass descheduled on a loaded machine must not judge the other cores busy here
    monkeypatch.setattr(thread_choice, "_idle_ticks", lambda: None)

    cores = torch.get_num_threads()
    batched = [await compute.run(_threads_of_this_thread, rows=ROWS, decode=True, batched=True) for _ in range(2)]
    assert batched == [1, cores]  # a batched pass: the whole pass, each count tried once
    single = [await compute.run(_threads_of_this_thread, rows=ROWS, decode=True) for _ in range(2)]
    assert single == [1, cores]  # one request of the same size: measured apart, so tried afresh
    prefill = await compute.run(_threads_of_this_thread, rows=512, decode=True)
    assert prefill == cores  # a long prompt: every thread, not measured
    backward = await compute.run(_threads_of_this_thread, rows=1)
    assert backward == 1  # training on one row: one thread, as a batch in parts must sum alike


def test_a_pass_on_one_thread_judges_the_other_cores_by_their_idle_ticks(monkeypatch):
    readings = iter([1000, 1000, 2000, 2004])  # busy: no idle tick in the pass; then free: 4 of ~6
    monkeypatch.setattr(thread_choice, "_idle_ticks", lambda: next(readings))
    clock = _fake_clock(monkeypatch)
    choice = ThreadChoice(max_threads=2)
    choice._others_ticks_per_s = 100  # one other core, 100 ticks a second
    choice.run(8, clock.pass_of(0.06))  # on one thread (untried), 6 of the other core's ticks
    assert choice.others_free is False
    choice.record(8, 2, 0.001)  # two threads already measured faster: the next pass uses them
    choice.run(8, clock.pass_of(0.06))  # and reads no /proc/stat (the readings would run out)
    for _ in range(3):
        choice.record(8, 2, 1.0)  # now slower than one thread, pass after pass
    choice.run(8, clock.pass_of(0.06))
    assert choice.others_free is True


def test_other_cores_turning_free_make_a_size_settled_on_one_thread_try_more_at_once(monkeypatch):
    readings = iter([1000, 1000, 2000, 2004])  # a busy one-thread pass, then a free one (4 idle ticks of ~6)
    monkeypatch.setattr(thread_choice, "_idle_ticks", lambda: next(readings))
    clock = _fake_clock(monkeypatch)
    choice = ThreadChoice(max_threads=2)
    choice._others_ticks_per_s = 100  # one other core, 100 ticks a second
    _run(choice, 2, {1: 0.140, 2: 0.120})
    _run(choice, 8 * RETRY_EVERY, {1: 0.140, 2: 2.0})  # the other core got busy: one thread, tries lost
    assert choice.choose(ROWS) == 1
    choice.run(ROWS, clock.pass_of(0.06))  # on one thread, the other core busy
    assert choice.choose(ROWS) == 1
    choice.run(ROWS, clock.pass_of(0.06))  # on one thread, the other core free again
    assert [choice.choose(ROWS) for _ in range(TRY_PASSES)] == [2] * TRY_PASSES  # a try, not 128 passes later


def test_passes_too_short_to_judge_the_other_cores_read_no_proc_stat(monkeypatch):
    """A 3 ms decode pass spans no clock tick of the other cores: reading /proc/stat around it (about
    0.1 ms, at every pass of a small model) could never change the judgement, so it is not read; a
    size whose recent one-thread passes include one long enough is judged again."""
    reads = []
    monkeypatch.setattr(thread_choice, "_idle_ticks", lambda: reads.append(1) or 1000)
    clock = _fake_clock(monkeypatch)
    choice = ThreadChoice(max_threads=2)
    choice._others_ticks_per_s = 100  # one other core, 100 ticks a second: a judgement needs 50 ms
    choice.run(8, clock.pass_of(0.003), threads=1)  # the size's first pass: its length is not known yet
    assert len(reads) == 2
    for _ in range(3):
        choice.run(8, clock.pass_of(0.003), threads=1)
    assert len(reads) == 2  # known short: none read
    choice.record(8, 1, 0.06)  # one of its recent passes lasted 6 ticks
    choice.run(8, clock.pass_of(0.003), threads=1)
    assert len(reads) == 4
