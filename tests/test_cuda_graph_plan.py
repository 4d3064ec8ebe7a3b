"""The CUDA-graph extend plan (lmc/runtime/cuda_graph.py) on the CPU: which extends replay graphs, in which chunks.
The replays themselves are tested on the GPU against eager execution (tests/test_cuda_graph.py)."""
from hypothesis import given
from hypothesis import strategies as st

from lmc.runtime.cuda_graph import EXTEND_MAX_REREAD_BYTES, DecodeGraphs, extend_chunks


@given(st.integers(1, 2000), st.integers(1, 128))
def test_chunks_cover_the_extend_in_order(n, chunk):
    spans = extend_chunks(n, chunk)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))  # contiguous, in order
    assert all(0 < b - a <= chunk for a, b in spans) and len(spans) == -(-n // chunk)


def graphs(weight_bytes: int, kv_bytes_per_token: int, extend_max: int = 64) -> DecodeGraphs:
    g = object.__new__(DecodeGraphs)  # the plan's fields only: no runner, no capture
    g.weight_bytes, g.kv_bytes_per_token, g.extend_max = weight_bytes, kv_bytes_per_token, extend_max
    return g


SMOLLM2 = graphs(weight_bytes=270 << 20, kv_bytes_per_token=2 * 30 * 3 * 64 * 2)  # bf16
LLAMA_7B = graphs(weight_bytes=13_500 << 20, kv_bytes_per_token=2 * 32 * 4096 * 2)


def test_small_models_chunk_long_extends_large_ones_do_not():
    assert SMOLLM2.replays_extend(192, 500)  # three chunks: two more weight reads of 0.27 GB
    assert SMOLLM2.replays_extend(64, 2000)
    assert not SMOLLM2.replays_extend(2048, 2048)  # a long prompt: its re-reads would cost more than launches
    assert LLAMA_7B.replays_extend(16, 500)
    assert not LLAMA_7B.replays_extend(65, 100)  # a second chunk reads 13 GB of weights again


def test_the_budget_counts_weights_once_per_extra_chunk():
    g = graphs(weight_bytes=1 << 30, kv_bytes_per_token=0)
    extra = EXTEND_MAX_REREAD_BYTES // (1 << 30)
    assert g.replays_extend(64 * (extra + 1), 1) and not g.replays_extend(64 * (extra + 1) + 1, 1)
