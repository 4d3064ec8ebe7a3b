"""CUDA graphs for decode: one captured forward per batch-size bucket, replayed with inputs copied into static
buffers. A decode step of a 7B model launches ~1,000 kernels; replaying them as one graph removes the per-launch
CPU cost that otherwise dominates at small batch.

Padding rows of a bucket use the dummy row 0 (all zeros -> dummy slot 0), sequence length 1, token 0 and output
slot 0, so they read and write only the dummy slot. Attention is captured with `max_seq_len` equal to the context
length, so one graph serves every sequence length (the backend's prepare_capture() builds length-independent
metadata; its prepare_replay() hook runs before each replay). Replay takes device tensors (the step's metadata
arrived in the runner's one host-to-device copy): filling the static buffers is device-to-device, no host sync.
The graph's first kernel derives the rest from the rows, positions and slots (kernels/triton_ops.decode_inputs):
the input ids gathered from the token buffer, the sequence lengths, and the new tokens' slots written into the
slot table, one launch inside the graph where these were five small launches and copies outside it.

A batch whose requests share a long cached prefix (ForwardBatch.shared_prefix) replays a second graph of its
bucket, captured on first use, whose attention reads that prefix once for the batch (the cascade of
attention/triton_kernels.decode_attention), its length in a device int written before each replay.

A small extend (a few new tokens on a cached prefix: what a program's text between two calls is) replays a third
graph of its bucket, also captured on first use: each new token is a decode row of its own, on its request's
slot-table row at its own position. The graph writes every row's slot into the table before the first layer and
each layer stores every row's K/V before its attention runs, so row i attends to positions [0, position_i]: the
causal extend, in one replay where an eager forward costs ~25 ms of kernel launches on the H200 (SmolLM2, see
benchmarks/gpu_forward_probe.py). Its input ids are copied in (the host has them); a running request decoding
inside that forward reads its id from the token buffer before the replay. An extend of more tokens than the
largest bucket replays it several times, one chunk of tokens after the other (a chunk's rows attend to the KV the
chunks before it wrote): what a compiled program's forwards are, the texts of many instances' next calls at
once, which eagerly cost those ~25 ms each (a trace of 32 counted_list instances on the H200: 8 of 11 extends,
2/3 of the run's time). Each extra chunk reads the weights once more, so only small models chunk (the budget).
"""
from __future__ import annotations

import torch

from .attention import ForwardBatch
from .kernels import triton_ops
from .memory import DUMMY_ROW

assert DUMMY_ROW == 0  # the zero-initialized static inputs and _pad write the dummy step as zeros

# An extend replays graphs, in chunks of at most this many rows (a bucket), while what the replays read beyond an
# eager forward stays small: each new token, a decode row of its own, reads its whole context, where the eager
# extend kernel reads it once per block of tokens, and each chunk after the first reads the weights again.
# 4 GB (~1 ms of the H200's bandwidth) against the ~25 ms of launches the replays save; a 7B's 16 tokens on a
# 500-token context read 4 GB (one chunk: its weights are 13 GB), SmolLM2's 64 on 2,000 tokens 3 GB, its 192 on
# 500 tokens 2.7 GB (three chunks, 0.5 GB of weights read twice more).
EXTEND_MAX_TOKENS = 64
EXTEND_MAX_REREAD_BYTES = 4 << 30


def extend_chunks(num_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each replay of an extend of `num_tokens` tokens in chunks of at most `chunk` rows."""
    return [(a, min(a + chunk, num_tokens)) for a in range(0, num_tokens, chunk)]


def buckets(max_bs: int) -> list[int]:
    return sorted({b for b in [1, 2, 4, 8, *range(16, max_bs + 1, 16)] if b <= max_bs} | {max_bs})


class DecodeGraphs:
    def __init__(self, runner, max_bs: int):
        self.runner, self.max_bs = runner, max_bs
        dev = runner.device
        self.ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        # A step's rows, positions and slots as the rows of one buffer, filled by one copy (replay's `inputs`).
        self.inputs = torch.zeros(3, max_bs, dtype=torch.long, device=dev)  # (zeros: the dummy step, _pad)
        self.rows, self.positions, self.slots = self.inputs
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.arange = torch.arange(max_bs, device=dev)
        self.shared_prefix = torch.zeros(1, dtype=torch.int32, device=dev)  # the cascade graphs' prefix length
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.batches: dict[int, ForwardBatch] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.cascade: dict[int, tuple[torch.cuda.CUDAGraph, ForwardBatch, torch.Tensor]] = {}  # by bucket, lazily
        self.extend: dict[int, tuple[torch.cuda.CUDAGraph, ForwardBatch, torch.Tensor]] = {}  # likewise
        self.extend_max = min(EXTEND_MAX_TOKENS, max_bs)
        k = runner.kv.k
        self.kv_bytes_per_token = 2 * len(k) * k[0][0].numel() * k[0].element_size()  # every layer's K and V
        self.weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        self.pool = None
        for bs in reversed(buckets(max_bs)):  # largest first, so smaller graphs reuse its memory pool
            self.graphs[bs], self.batches[bs], self.logits[bs] = self._capture(bs, cascade=False)

    def _batch(self, bs: int, cascade: bool) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            is_decode=True, rows=self.rows[:bs], prefix_lens=self.seq_lens[:bs] - 1,
            extend_lens=torch.ones_like(self.seq_lens[:bs]), seq_lens=self.seq_lens[:bs],
            extend_start=self.arange[:bs], max_extend_len=1, max_seq_len=r.context_length,
            positions=self.positions[:bs], out_slots=self.slots[:bs], logits_index=self.arange[:bs],
            kv_cache=r.kv, req_to_token=r.table, attn=r.attn, shared_prefix=self.shared_prefix if cascade else 0)

    @torch.inference_mode()
    def _capture(self, bs: int, cascade: bool, gather_ids: bool = True
                 ) -> tuple[torch.cuda.CUDAGraph, ForwardBatch, torch.Tensor]:
        """Capture bucket `bs` over the static buffers, which hold the dummy step (padding values) meanwhile.
        gather_ids=False: the extend graph, whose input ids are copied into the static buffer before a replay."""
        self._pad(0, bs)
        self.shared_prefix.zero_()
        batch = self._batch(bs, cascade)
        self.runner.attn.prepare_capture(batch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph: kernel compilation, cuBLAS handles
            self._step(bs, batch, gather_ids)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            logits = self._step(bs, batch, gather_ids)
        self.pool = g.pool()
        return g, batch, logits

    def _step(self, bs: int, batch: ForwardBatch, gather_ids: bool) -> torch.Tensor:
        """What a graph runs: the step's inputs from its rows, positions and slots (module docstring), the forward."""
        r = self.runner
        triton_ops.decode_inputs(r.token_buf if gather_ids else None, r.table, self.rows[:bs], self.positions[:bs], self.slots[:bs],
                                 self.ids[:bs], self.seq_lens[:bs])
        return r.model(self.ids[:bs], batch)

    def _pad(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) of the static buffers to the dummy step: the dummy row, position 0, slot 0 (so sequence
        length 1 and the dummy slot, whatever token the graph's gather finds in the dummy row's buffer entry)."""
        if hi > lo:  # one fill: the dummy row is row 0
            self.inputs[:, lo:hi] = 0

    def replays_extend(self, num_tokens: int, max_seq_len: int) -> bool:
        """Whether an extend forward of `num_tokens` new tokens, none past position `max_seq_len`, replays graphs
        (module docstring; EXTEND_MAX_REREAD_BYTES): its attention's re-reads and the extra chunks' weight reads."""
        extra_chunks = -(-num_tokens // self.extend_max) - 1
        reread = num_tokens * max_seq_len * self.kv_bytes_per_token + extra_chunks * self.weight_bytes
        return reread <= EXTEND_MAX_REREAD_BYTES

    @torch.inference_mode()
    def replay_extend(self, ids: torch.Tensor, tokens: torch.Tensor, logit_pos: torch.Tensor) -> torch.Tensor:
        """An extend of n tokens (replays_extend said yes): their [n] ids and [3, n] device tensor of each token's
        slot-table row (its request's), position and KV slot. Returns the logits at the token indices `logit_pos`
        ([L, V], a tensor of its own: a chunk's rows are copied out of the graph's buffer before the next replay
        overwrites it). The chunks run in order on the stream, so a token's context (earlier chunks') is written
        when its chunk attends."""
        chunks = extend_chunks(tokens.shape[1], self.extend_max)
        if len(chunks) == 1:
            return self._replay_chunk(ids, tokens)[logit_pos]
        out = None
        for a, b in chunks:
            logits = self._replay_chunk(ids[a:b], tokens[:, a:b])
            local = logit_pos - a
            mine = ((local >= 0) & (local < b - a))[:, None]
            got = logits[local.clamp(0, b - a - 1)]  # (a gather, not a masked select: no host sync)
            out = got if out is None else torch.where(mine, got, out)
        return out

    def _replay_chunk(self, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One replay of the extend graph of the smallest bucket that holds these n tokens: their [n, V] logits, a
        view of the graph's buffer valid until the next replay."""
        n = tokens.shape[1]
        bs = next(b for b in sorted(self.graphs) if b >= n)
        if bs not in self.extend:
            self.extend[bs] = self._capture(bs, cascade=False, gather_ids=False)
        graph, batch, logits = self.extend[bs]
        self.ids[:n].copy_(ids)  # (rows past n: a padding row embeds whatever id is left there, harmlessly)
        self._fill(tokens, bs)
        self.runner.attn.prepare_replay(batch, n)
        graph.replay()
        return logits[:n]

    def _fill(self, inputs: torch.Tensor, bs: int) -> None:
        """The static buffers from [3, n] rows, positions and slots, in one copy; rows n..bs padded."""
        n = inputs.shape[1]
        self.inputs[:, :n].copy_(inputs)
        self._pad(n, bs)  # a previous larger batch may have left real rows there

    @torch.inference_mode()
    def replay(self, inputs: torch.Tensor, shared_prefix: int = 0) -> torch.Tensor:
        """`inputs`: one decode step's [3, n] device tensor of its rows, positions and KV slots (its input ids are in
        the runner's token buffer at the rows; its slots are written into the slot table by the graph);
        `shared_prefix` as in ForwardBatch.
        Returns its [n, V] logits: a view of the graph's static buffer, valid until the next replay. Work queued
        on the stream before that replay (the step's sampling) may read it in place; a reader after it (logprobs,
        read when the step is collected) needs the copy that ModelRunner.launch takes for such steps."""
        n = inputs.shape[1]
        bs = next(b for b in sorted(self.graphs) if b >= n)
        if self.runner.attn.reads_shared_prefix(n, shared_prefix, self.runner.kv):
            if bs not in self.cascade:  # before the buffers are filled: capture runs on the dummy step
                self.cascade[bs] = self._capture(bs, cascade=True)
            graph, batch, logits = self.cascade[bs]
            self.shared_prefix.fill_(shared_prefix)
        else:
            graph, batch, logits = self.graphs[bs], self.batches[bs], self.logits[bs]
        self._fill(inputs, bs)
        self.runner.attn.prepare_replay(batch, n)
        graph.replay()
        return logits[:n]
