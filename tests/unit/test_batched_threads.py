"""The server's choice of threads for the linear layers of batched passes, from the passes' own times."""

import time

from bloompeer.peer.server import batched_threads
from bloompeer.peer.server.batched_threads import RETRY_EVERY, BatchedThreadChoice

ROWS = 8


def _run(choice: BatchedThreadChoice, passes: int, seconds: dict[int, float]) -> list[int]:
    chosen = []
    for _ in range(passes):
        threads = choice.choose(ROWS)
        choice.record(ROWS, threads, seconds[threads])
        chosen.append(threads)
    return chosen


def test_tries_each_count_then_keeps_the_faster_and_tries_the_other_less_often_each_time_it_loses():
    choice = BatchedThreadChoice(max_threads=2)
    chosen = _run(choice, 2 + 7 * RETRY_EVERY, {1: 0.140, 2: 0.120})
    assert chosen[:2] == [1, 2]
    tries = [index for index, threads in enumerate(chosen[2:], start=1) if threads == 1]
    assert tries == [RETRY_EVERY, 3 * RETRY_EVERY, 7 * RETRY_EVERY]  # 16 passes, then 32, then 64


def test_one_slow_pass_switches_and_one_winning_try_switches_back():
    choice = BatchedThreadChoice(max_threads=2)
    _run(choice, 4, {1: 0.140, 2: 0.120})
    assert _run(choice, 1, {1: 0.140, 2: 0.390}) == [2]  # the other core got busy during this pass
    busy = _run(choice, 4 * RETRY_EVERY, {1: 0.140, 2: 2.0})
    assert busy.count(2) == 2  # tried after 16 passes, lost, then after 32 more
    free = _run(choice, 2 * 4 * RETRY_EVERY, {1: 0.140, 2: 0.120})  # the core is free again
    switched = free.index(2)
    assert switched < 4 * RETRY_EVERY  # the next try (due after 64 passes since the last) wins
    after = free[switched + 1:]
    assert [i for i, threads in enumerate(after, start=1) if threads == 1][:2] == [RETRY_EVERY, 3 * RETRY_EVERY]


def test_more_threads_are_tried_only_while_the_other_cores_look_free():
    choice = BatchedThreadChoice(max_threads=2)
    choice.others_free = False
    assert _run(choice, 3 * RETRY_EVERY, {1: 0.140, 2: 0.120}) == [1] * (3 * RETRY_EVERY)  # not even a first try
    choice.others_free = True
    assert _run(choice, 3, {1: 0.140, 2: 0.120}) == [2, 2, 2]  # the first try, due long ago, wins


def test_sizes_are_measured_apart_and_one_core_means_one_thread():
    choice = BatchedThreadChoice(max_threads=2)
    _run(choice, 4, {1: 0.140, 2: 0.120})
    assert choice.choose(64) == 1  # 64 rows: not measured yet
    single = BatchedThreadChoice(max_threads=1)
    assert {single.choose(ROWS) for _ in range(3 * RETRY_EVERY)} == {1}


def _batched_threads_of_this_thread() -> int | None:
    from bloompeer.blocks.batched_linear import batched_threads as current

    return current()


async def test_the_compute_thread_sets_the_count_per_batched_pass_and_leaves_other_calls_alone(compute):
    import torch

    cores = torch.get_num_threads()
    first = [await compute.run(_batched_threads_of_this_thread, rows=ROWS, decode=True, batched=True)
             for _ in range(2)]
    assert first == [1, cores]  # each count tried once, on the compute thread itself
    before = await compute.run(_batched_threads_of_this_thread, rows=ROWS, decode=True)
    assert before == cores  # a pass of one request is not measured: the count stays as the last batched pass set it


def test_a_pass_on_one_thread_judges_the_other_cores_by_their_idle_ticks(monkeypatch):
    readings = iter([1000, 1000, 2000, 2004])  # busy: no idle tick in the pass; then free: 4 of ~6
    monkeypatch.setattr(batched_threads, "_idle_ticks", lambda: next(readings))
    choice = BatchedThreadChoice(max_threads=2)
    choice._others_ticks_per_s = 100  # one other core, 100 ticks a second
    choice.run(8, lambda: time.sleep(0.06))  # on one thread (untried), 6 of the other core's ticks
    assert choice.others_free is False
    choice.record(8, 2, 0.001)  # two threads already measured faster: the next pass uses them
    choice.run(8, lambda: time.sleep(0.06))  # and reads no /proc/stat (the readings would run out)
    choice.record(8, 2, 1.0)  # now slower than one thread
    choice.run(8, lambda: time.sleep(0.06))
    assert choice.others_free is True
