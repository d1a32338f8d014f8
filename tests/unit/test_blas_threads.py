"""The server's choice of OpenBLAS threads for batched passes, from the passes' own times."""

from bloompeer.peer.server.blas_threads import RETRY_EVERY, BlasThreadChoice

ROWS = 8


def _run(choice: BlasThreadChoice, passes: int, seconds: dict[int, float]) -> list[int]:
    chosen = []
    for _ in range(passes):
        threads = choice.choose(ROWS)
        choice.record(ROWS, threads, seconds[threads])
        chosen.append(threads)
    return chosen


def test_tries_each_count_then_keeps_the_faster_and_retries_the_other_now_and_then():
    choice = BlasThreadChoice(max_threads=2)
    chosen = _run(choice, 2 + 2 * RETRY_EVERY, {1: 0.140, 2: 0.120})
    assert chosen[:2] == [1, 2]
    later = chosen[2:]
    assert later.count(1) == 2 and later.count(2) == len(later) - 2  # one retry of one thread per RETRY_EVERY
    assert later[RETRY_EVERY - 1] == 1


def test_one_slow_pass_on_two_threads_switches_to_one_and_a_free_core_switches_back():
    choice = BlasThreadChoice(max_threads=2)
    _run(choice, 4, {1: 0.140, 2: 0.120})
    assert _run(choice, 1, {1: 0.140, 2: 0.390}) == [2]  # the other core got busy during this pass
    assert _run(choice, 3, {1: 0.140, 2: 0.390}) == [1, 1, 1]
    after = _run(choice, 2 * RETRY_EVERY, {1: 0.140, 2: 0.120})  # the core is free again
    assert after[-1] == 2 and after.count(1) < RETRY_EVERY + 2


def test_sizes_are_measured_apart_and_one_core_means_one_thread():
    choice = BlasThreadChoice(max_threads=2)
    _run(choice, 4, {1: 0.140, 2: 0.120})
    assert choice.choose(64) == 1  # 64 rows: not measured yet
    single = BlasThreadChoice(max_threads=1)
    assert {single.choose(ROWS) for _ in range(3 * RETRY_EVERY)} == {1}


def _blas_threads_of_this_thread() -> set[int]:
    from threadpoolctl import ThreadpoolController

    return {library.get_num_threads() for library in ThreadpoolController().select(user_api="blas").lib_controllers}


async def test_the_compute_thread_sets_openblas_per_batched_pass_and_leaves_other_calls_alone(compute):
    import torch

    cores = torch.get_num_threads()
    first = [await compute.run(_blas_threads_of_this_thread, rows=ROWS, decode=True, batched=True) for _ in range(2)]
    assert first == [{1}, {cores}]  # each count tried once, on the compute thread itself
    alone = await compute.run(_blas_threads_of_this_thread, rows=ROWS, decode=True)
    assert alone == {cores}  # a pass of one request does not use OpenBLAS: not measured, not set
