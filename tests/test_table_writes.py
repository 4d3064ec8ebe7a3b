"""The runner's slot-table write index (runner._table_write_index) against the writes spelled out one by one."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmc.runtime.runner import _table_write_index


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(0, 4000), st.integers(0, 40)), max_size=12))
def test_write_index_is_each_writes_row_and_columns_in_order(writes):
    """Each (row, first column, slots) write covers columns first .. first + len - 1 of its row, in order, the
    writes one after the other; none at all gives two empty int64 tensors."""
    tw = [(row, first, torch.arange(n)) for row, first, n in writes]
    rows, cols = _table_write_index(tw)
    assert rows.dtype == cols.dtype == torch.long
    assert rows.tolist() == [row for row, _, n in writes for _ in range(n)]
    assert cols.tolist() == [c for _, first, n in writes for c in range(first, first + n)]
