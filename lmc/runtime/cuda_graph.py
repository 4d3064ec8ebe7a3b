"""CUDA graphs for decode: one captured forward per batch-size bucket, replayed with inputs copied into static
buffers. A decode step of a 7B model launches ~1,000 kernels; replaying them as one graph removes the per-launch
CPU cost that otherwise dominates at small batch.

Padding rows of a bucket use the dummy row 0 (all zeros -> dummy slot 0), sequence length 1, token 0 and output
slot 0, so they read and write only the dummy slot. Attention is captured with `max_seq_len` equal to the context
length, so one graph serves every sequence length (the backend's prepare_capture() builds length-independent
metadata; its prepare_replay() hook runs before each replay). Replay takes device tensors (the step's metadata
arrived in the runner's one host-to-device copy, its input ids were gathered from the token buffer on the
device): filling the static buffers is device-to-device, no host sync.
"""
from __future__ import annotations

import torch

from .attention import ForwardBatch
from .memory import DUMMY_ROW


def buckets(max_bs: int) -> list[int]:
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if b <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, runner, max_bs: int):
        self.runner, self.max_bs = runner, max_bs
        dev = runner.device
        self.ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.slots = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.rows = torch.full((max_bs,), DUMMY_ROW, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.arange = torch.arange(max_bs, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        for bs in reversed(buckets(max_bs)):  # largest first, so smaller graphs reuse its memory pool
            self._capture(bs)

    def _batch(self, bs: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            is_decode=True, rows=self.rows[:bs], prefix_lens=self.seq_lens[:bs] - 1,
            extend_lens=torch.ones_like(self.seq_lens[:bs]), seq_lens=self.seq_lens[:bs],
            extend_start=self.arange[:bs], max_extend_len=1, max_seq_len=r.context_length,
            positions=self.positions[:bs], out_slots=self.slots[:bs], logits_index=self.arange[:bs],
            kv_cache=r.kv, req_to_token=r.table, attn=r.attn)

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        batch = self.batches[bs] = self._batch(bs)
        self.runner.attn.prepare_capture(batch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: kernel compilation, cuBLAS handles
            self.runner.model(self.ids[:bs], batch)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.logits[bs] = self.runner.model(self.ids[:bs], batch)
        self.pool = g.pool()
        self.graphs[bs] = g

    @torch.inference_mode()
    def replay(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor,
               seq_lens: torch.Tensor) -> torch.Tensor:
        """All arguments are [n] device tensors of one decode step. Returns its [n, V] logits: a view of the graph's
        static buffer, valid until the next replay. Work queued on the stream before that replay (the step's
        sampling) may read it in place; a reader after it (logprobs, read when the step is collected) needs the
        copy that ModelRunner.launch takes for such steps."""
        n = len(ids)
        bs = next(b for b in sorted(self.graphs) if b >= n)
        self.ids[:n].copy_(ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.rows[:n].copy_(rows)
        self.seq_lens[:n].copy_(seq_lens)
        # Padding rows: reset to the dummy values (a previous larger batch may have left real rows there).
        self.ids[n:bs], self.positions[n:bs], self.slots[n:bs] = 0, 0, 0
        self.rows[n:bs], self.seq_lens[n:bs] = DUMMY_ROW, 1
        self.runner.attn.prepare_replay(self.batches[bs], n)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
