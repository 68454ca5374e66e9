"""kernels/host_index.py: the numpy route gives the tensor torch.tensor would, for every input it takes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.host_index import long_tensor

INT64 = st.integers(-(2**63), 2**63 - 1)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.long and got.device.type == "cpu" and got.shape == want.shape
    assert torch.equal(got, want)


@settings(max_examples=80, deadline=None)
@given(values=st.lists(INT64, max_size=40))
def test_a_list_of_ints_is_torch_tensor_of_it(values):
    _same(long_tensor(values), torch.tensor(values, dtype=torch.long))


@settings(max_examples=60, deadline=None)
@given(start=st.integers(-50, 50), stop=st.integers(-50, 50), step=st.integers(-7, 7).filter(bool))
def test_a_range_is_its_arange(start, stop, step):
    _same(long_tensor(range(start, stop, step)), torch.tensor(list(range(start, stop, step)), dtype=torch.long))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 5), width=st.integers(0, 6), data=st.data())
def test_rows_of_equal_length_give_a_table(rows, width, data):
    table = [data.draw(st.lists(INT64, min_size=width, max_size=width)) for _ in range(rows)]
    want = torch.tensor(table, dtype=torch.long)
    if rows == 0:  # no rows: torch.tensor([]) is 1-D as well
        assert long_tensor(table).shape == want.shape == (0,)
        return
    _same(long_tensor(table), want)


def test_an_int64_array_is_shared_and_other_values_are_refused():
    a = np.arange(5, dtype=np.int64)
    t = long_tensor(a)
    a[0] = 42  # the tensor reads the array's buffer (no copy)
    assert t[0].item() == 42
    with pytest.raises(OverflowError):
        long_tensor([2**63])  # past int64, as torch.tensor refuses it
    with pytest.raises((TypeError, ValueError)):
        long_tensor([[1, 2], [3]])  # ragged rows are no table
