"""The CPU's intra-op thread count chosen by timing a step (runner/cpu_setup.py)."""
from __future__ import annotations

import time

import pytest
import torch

from kvship.runner import cpu_setup


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _step_taking(seconds_by_threads: dict[int, float]):
    def step():
        time.sleep(seconds_by_threads[torch.get_num_threads()])
    return step


@pytest.mark.parametrize("timings,want", [
    ({1: 0.004, 2: 0.030, 4: 0.050}, 1),  # more threads slower (a busy machine): one
    ({1: 0.030, 2: 0.012, 4: 0.013}, 2),  # two clearly faster, four no better than two
    ({1: 0.020, 2: 0.019, 4: 0.0185}, 1),  # within the margin: the fewest threads
])
def test_fastest_thread_count_is_kept(timings, want):
    chosen, measured = cpu_setup.choose_cpu_threads(_step_taking(timings), 4, reps=2)
    assert chosen == want and torch.get_num_threads() == want
    assert sorted(measured) == [1, 2, 4] and measured[4] >= timings[4]


def test_explicit_count_is_not_measured():
    def step():
        raise AssertionError("an explicit --cpu-threads is not timed")
    assert cpu_setup.set_cpu_threads(1, step) == "threads 1 (--cpu-threads)"
    assert torch.get_num_threads() == 1


def test_weight_format_names_dtypes_by_size():
    model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 600).to(torch.bfloat16))
    assert cpu_setup.weight_format(model) == "float32 4 MB, bfloat16 1 MB"


def test_weight_format_counts_kernel_held_tensors():
    class Held:  # as kernels/cpu_quant_linear.CpuQuantLinear keeps its codes
        def __init__(self, kind: str, dtype: torch.dtype):
            self.kind = kind
            self.codes = torch.zeros(2000, 1000, dtype=dtype)

    model = torch.nn.Linear(1000, 1000)
    model.kernel = Held("int8", torch.int8)
    assert cpu_setup.weight_format(model) == "float32 4 MB, int8 2 MB"
    model.kernel = Held("int4", torch.uint8)  # two codes a byte, packed
    assert cpu_setup.weight_format(model) == "float32 4 MB, int4 2 MB"
