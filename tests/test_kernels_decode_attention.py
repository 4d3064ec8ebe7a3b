"""Decode attention's batched-decode configuration (attention/triton_kernels._decode_config: 32-key tiles and 2
warps once batch x KV heads fills the SMs): the same numbers as the reference, every tile partial or empty."""
from triton_device import kernel_device  # noqa: F401  (first: sets TRITON_INTERPRET where there is no GPU)

import pytest

pytest.importorskip("triton")

from test_triton_kernels import run_decode  # noqa: E402

from lmc.runtime.attention import triton_kernels as tk  # noqa: E402


def test_batched_decode_config_is_taken_and_correct(monkeypatch):
    monkeypatch.setattr(tk, "_H200_SMS", 4)  # 3 requests x 2 KV heads count as a batched decode here
    assert tk._decode_config(6, 128 * 4) == (32, 2, 2)
    run_decode([1, 37, 70], num_heads=4, num_kv_heads=2, head_dim=64, max_seq_len=200)
