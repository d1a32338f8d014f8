"""`serve --device`: a device this machine's torch cannot compute on is refused before anything loads."""

import pytest

from bloompeer.peer.server.compute import check_device


def test_a_device_this_machine_lacks_is_refused_saying_what_to_do():
    check_device("cpu")
    # a CPU build of torch (CI), a machine without a GPU, or one with fewer than 100 GPUs
    with pytest.raises(ValueError, match=r"^--device cuda:99: .*(built without CUDA.*--device cpu|no CUDA device|"
                                         r"has \d+ CUDA device\(s\), cuda:0 to)"):
        check_device("cuda:99")
