"""ModelRunner: owns the model, the device-side KV memory (KV buffers, slot table, token buffer) and the attention
backend; turns a scheduled batch into one forward, then samples and extracts logprobs. It knows nothing of queues
or the radix tree.

A step is split so that the host can work while the device computes (overlap scheduling, scheduler/):
- `launch(sb)`: pack the batch's metadata into one host tensor, copy it to the device in one (pinned, on CUDA)
  copy, write the batch's slots into the device slot table, gather the input ids the host does not know yet from
  the token buffer, and run the forward (a step replayed from a CUDA graph, a decode or a small extend, writes the
  table itself, and a decode gathers its ids too).
  Returns a handle at once.
- `sample(handle, grammar_reqs)`: mask, sample, write the sampled ids into the token buffer (one entry per slot-
  table row: the request's last token, which its next decode step reads on the device), and start their copy to
  the host. Separate from launch because a grammar's mask needs the previous step's token accepted first.
- `collect(handle)`: wait for the sampled ids; logprobs for the requests that asked.
On CUDA the device work is asynchronous by nature (one stream). On the CPU it runs on one thread in submission
order, the CPU's stand-in for a stream, one per process (`_cpu_device`), which also builds the model and the KV
memory: every OpenMP region of the engines in a process starts on that one thread, and their scheduler threads
run their own torch ops serially (`host_thread`). (Where two threads each run parallel regions, libgomp counts more
threads than cores and cuts its spin-wait short: each of a decode step's ~120 small parallel regions then wakes
its second thread through the kernel, and the embedded model's linears took 8.0 ms a step instead of 3.6.) Either
way, errors raised by device work surface at collect(). The device slot table and token buffer are only ever
touched by device work, in stream order: the scheduler keeps its own host copy of the table and never reads this
one.
Under tensor parallelism every rank runs the same `_forward` on its shard: rank 0 broadcasts the packed step to the
workers (distributed/workers.py), each writes its own slot table from it, and a step that reads the token buffer
first copies rank 0's (only rank 0 samples) to every rank, in stream order like the rest of the forward.
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from .attention import ForwardBatch, make_backend
from .core import Req
from .grammar import apply_grammar_masks
from .memory import DUMMY_ROW, KVCache
from .model.gguf_blocks import checked_gguf_blocks
from .model.linear import Linear, prepack_linears
from .model.llama import LlamaForCausalLM, ModelConfig, rope_cos_sin
from .sampling import sample, token_logprobs


@dataclass
class ScheduledBatch:
    """One forward as flat arrays over its B requests and T new tokens. Request i's new tokens are the flat
    range [extend_start[i], extend_start[i] + extend_lens[i]), at positions prefix_lens[i] onwards, writing KV
    into out_slots over that range (allocated by the scheduler, which also wrote them into its host table).

    `reqs` is there for the scheduler's processing and the sampler's per-request parameters; the runner never
    walks it to build tensors. Input ids: a decode batch reads all of them from the device token buffer
    (`input_ids` is empty); a prefill batch carries them, except for the requests in `from_buffer` (running
    requests decoding inside a prefill: one token each, still on the device).
    """

    reqs: list[Req]
    is_decode: bool
    rows: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]
    out_slots: torch.Tensor  # CPU int64 [T]
    sample: list[bool]  # does request i sample a token in this forward (false for a non-final chunk)
    epochs: list[int]  # each request's Req.epoch when scheduled: a changed epoch marks its entry stale
    from_buffer: list[int] = field(default_factory=list)
    logprob_reqs: list[int] = field(default_factory=list)  # requests that asked for logprobs
    # Slot-table writes other than the new tokens' (a resident request's adopted prefix): (row, start, slots).
    table_writes: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    shared_prefix: int = 0  # decode: positions [0, n) hold the same slots in every request's row (ForwardBatch)

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def extend_start(self) -> list[int]:
        return list(itertools.accumulate(self.extend_lens, initial=0))[:-1]

    def select(self, idx: list[int]) -> "ScheduledBatch":
        """The sub-batch of requests `idx` (in order), with their tokens and slots (failure bisection)."""
        starts, pos = self.extend_start, {i: k for k, i in enumerate(idx)}
        spans = [(starts[i], starts[i] + self.extend_lens[i]) for i in idx]
        tok = [t for lo, hi in spans for t in range(lo, hi)]
        return ScheduledBatch(
            [self.reqs[i] for i in idx], self.is_decode, [self.rows[i] for i in idx],
            [self.prefix_lens[i] for i in idx], [self.extend_lens[i] for i in idx],
            [] if self.is_decode else [self.input_ids[t] for t in tok], self.out_slots[tok],
            [self.sample[i] for i in idx], [self.epochs[i] for i in idx],
            [pos[i] for i in self.from_buffer if i in pos], [pos[i] for i in self.logprob_reqs if i in pos],
            self.table_writes, self.shared_prefix)  # idempotent: every part re-applies them; a part shares as much


class BatchBuilder:
    """Accumulates a prefill batch's flat arrays, request by request."""

    def __init__(self):
        self.reqs, self.rows, self.prefix_lens, self.extend_lens, self.input_ids = [], [], [], [], []
        self.slots, self.sample, self.epochs, self.from_buffer, self.logprob_reqs = [], [], [], [], []

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, r: Req, prefix: int, ext: int, slots: torch.Tensor, sample: bool, from_buffer: bool = False):
        """r's positions [prefix, prefix + ext). from_buffer: its one new token is its last sampled one, read
        from the device token buffer (the host may not have it yet)."""
        if from_buffer:
            self.from_buffer.append(len(self.reqs))
            self.input_ids.append(0)
        else:
            self.input_ids.extend(_tokens(r, prefix, prefix + ext))
        if r.params.return_logprob:
            self.logprob_reqs.append(len(self.reqs))
        self.reqs.append(r)
        self.rows.append(r.row)
        self.prefix_lens.append(prefix)
        self.extend_lens.append(ext)
        self.slots.append(slots)
        self.sample.append(sample)
        self.epochs.append(r.epoch)

    def build(self, table_writes) -> ScheduledBatch:
        return ScheduledBatch(self.reqs, False, self.rows, self.prefix_lens, self.extend_lens, self.input_ids,
                              torch.cat(self.slots), self.sample, self.epochs, self.from_buffer, self.logprob_reqs,
                              table_writes)


def decode_batch(reqs: list[Req], prefix_lens: list[int], slots: torch.Tensor, table_writes,
                 shared_prefix: int = 0) -> ScheduledBatch:
    n = len(reqs)
    return ScheduledBatch(reqs, True, [r.row for r in reqs], prefix_lens, [1] * n, [], slots, [True] * n,
                          [r.epoch for r in reqs], [], [i for i, r in enumerate(reqs) if r.params.return_logprob],
                          table_writes, shared_prefix)


@dataclass
class StepOutput:
    next_ids: list[int | None] = field(default_factory=list)
    # per request: (logprob, top, by_id) of the sampled token, and [(position, logprob, top)] for prompt tokens
    out_logprobs: list = field(default_factory=list)
    in_logprobs: list = field(default_factory=list)


@dataclass
class Launch:
    """A launched step. Logits rows: first the sampled requests' (in batch order), then the prompt-logprob
    positions of each request in `spans` (request, first position, count)."""

    sb: ScheduledBatch
    sampled: list[int]  # requests that sample, in batch order
    spans: list[tuple[int, int, int]]
    forward: Future  # -> (logits, device rows of the sampled requests)
    tokens: Future | None = None  # -> (host tensor of sampled ids, CUDA event or None)


def _tokens(r: Req, lo: int, hi: int) -> list[int]:
    """r.fill_ids[lo:hi] without building fill_ids (a decode step would copy the whole sequence per request)."""
    n = len(r.input_ids)
    if lo >= n:
        return r.output_ids[lo - n:hi - n]
    return r.input_ids[lo:hi] + r.output_ids[:max(0, hi - n)]


def _spans_index(rows, starts, lens) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every entry of the spans (rows[i], columns starts[i] .. starts[i] + lens[i] - 1), as two
    int64 tensors, built without per-entry Python: a prefill that adopts a 1,200-token prefix for 127 requests
    writes 152k slot-table entries. In numpy: 0.16 ms for those 127 spans and 6 us for an extend's one, where
    torch's CPU repeat_interleave took 1.8 ms and 22 us."""
    lens = np.asarray(lens, dtype=np.int64)
    out_rows = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    first = np.asarray(starts, dtype=np.int64) - (np.cumsum(lens) - lens)
    cols = np.arange(len(out_rows), dtype=np.int64) + np.repeat(first, lens)
    return torch.from_numpy(out_rows), torch.from_numpy(cols)


def _table_write_index(tw: list[tuple[int, int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, column) of every slot-table write of `tw` (row, first column, slots)."""
    if not tw:
        return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    return _spans_index([row for row, _, _ in tw], [start for _, start, _ in tw], [len(s) for _, _, s in tw])


def _own_logits(forward: Future) -> tuple[torch.Tensor, torch.Tensor]:
    logits, sample_rows = forward.result()
    return logits.clone(), sample_rows


class _Inline:
    """Device work run at once on the calling thread; errors are kept in the future (raised by collect)."""

    @staticmethod
    def submit(fn, *args) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 -- handed to collect(), which re-raises it
            fut.set_exception(e)
        return fut


_cpu_lock = threading.Lock()
_cpu_thread: list[ThreadPoolExecutor] = []
os.register_at_fork(after_in_child=_cpu_thread.clear)  # a forked child has no thread: it starts its own


def _cpu_device() -> ThreadPoolExecutor:
    """The CPU's stand-in for a CUDA stream: device work run in submission order on one thread, one per process and
    shared by its CPU engines, so that the process's OpenMP regions start on one thread however many engines it
    holds (module docstring)."""
    with _cpu_lock:
        if not _cpu_thread:
            _cpu_thread.append(ThreadPoolExecutor(1, thread_name_prefix="lmc-cpu-device"))
        return _cpu_thread[0]


class ModelRunner:
    def __init__(self, hf_config, weights, *, device: torch.device, dtype: torch.dtype, attention: str,
                 max_total_tokens: int, max_running: int, context_length: int, seed: int = 0,
                 mem_fraction: float = 0.85, cuda_graph_max_bs: int = 256, enable_torch_compile: bool = False,
                 tp=None, matmul_dtype: torch.dtype | None = None, gguf_blocks=None):
        """`enable_torch_compile`: run forwards that are not CUDA-graph replays through torch.compile (compiled.py),
        compiling at construction (a warm-up forward per shape class) so no request waits for it.
        `tp`: this rank's distributed.workers.RankShard under tensor parallelism (None: the whole model here);
        `weights` then yields safetensors slices, of which only this rank's pieces are read.
        `matmul_dtype`: the CPU linears' weights packed in this dtype (bf16: model/linear.py), the rest of the model
        and the KV cache in `dtype`; None: `dtype` throughout.
        `gguf_blocks`: the GGUF the weights came from, whose Q4_1 / Q8_0 blocks the CPU's fp32-panel linears then
        run on (model/gguf_blocks.py: the same outputs, fewer bytes a step)."""
        self.cfg = ModelConfig.from_hf(hf_config)
        self.device, self.dtype = device, dtype
        self.context_length = context_length
        self.tp = tp
        self._pinned = device.type == "cuda"
        # The stream every step runs on, looked up once: torch.cuda.current_stream() costs ~40 us of host time a
        # call on the lent H100's host (a profile of a decode loop), and sampling records an event on it each step
        self._stream = torch.cuda.current_stream(device) if self._pinned else None
        self._work = _cpu_device() if device.type == "cpu" else _Inline()
        self.run_on_device(self._setup, hf_config, weights, seed, dtype, matmul_dtype, gguf_blocks, attention,
                           max_total_tokens, max_running, mem_fraction, enable_torch_compile, cuda_graph_max_bs)

    def _setup(self, hf_config, weights, seed, dtype, matmul_dtype, gguf_blocks, attention, max_total_tokens,
               max_running, mem_fraction, enable_torch_compile, cuda_graph_max_bs) -> None:
        """The model, the KV memory and the attention backend (on the device's thread: the CPU's is _cpu_device)."""
        device, context_length, tp = self.device, self.context_length, self.tp
        model = self._build_model(weights, seed)
        blocks = checked_gguf_blocks(model, gguf_blocks) if gguf_blocks is not None else None
        # CPU: weights into panels (or the GGUF's blocks) or oneDNN's layout (linear.py)
        prepack_linears(model, matmul_dtype or dtype, blocks)
        self.gguf_block_linears = sum(isinstance(m, Linear) and m.block_bits > 0 for m in model.modules())
        self.model = model.eval()
        self.model.rope = rope_cos_sin(hf_config, context_length, device, dtype)
        self.attn = make_backend(attention, device)
        c = self.cfg
        if not max_total_tokens:  # size the pool from what the device has left (GPU only)
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1 - mem_fraction) * total
            kv_heads = model.cfg.num_kv_heads  # this rank's, under tensor parallelism
            max_total_tokens = int(budget // KVCache.bytes_per_token(c.num_layers, kv_heads, c.head_dim, dtype))
            if tp is not None:
                max_total_tokens = tp.agree_min(max_total_tokens)  # one slot allocator serves every rank
            if max_total_tokens < context_length:
                raise RuntimeError(f"only {max_total_tokens} KV tokens fit on {device}; lower the context length")
        self.kv = KVCache(c.num_layers, max_total_tokens, model.cfg.num_kv_heads, c.head_dim, dtype, device)
        self.num_slots = max_total_tokens
        # Rows: the dummy row 0, max_running decoding requests and one chunked prefill.
        self.num_rows = max_running + 2
        self.table = torch.zeros((self.num_rows, context_length), dtype=torch.int32, device=device)
        self.token_buf = torch.zeros(self.num_rows, dtype=torch.long, device=device)
        self.step_model = model
        if enable_torch_compile:
            from .compiled import CompiledForward

            self.step_model = CompiledForward(model)
            self._warm_up()
        self.graphs = None
        if cuda_graph_max_bs and device.type == "cuda" and self.attn.supports_cuda_graph:
            from .cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, min(cuda_graph_max_bs, max_running))

    def _build_model(self, weights, seed: int) -> LlamaForCausalLM:
        """The model (this rank's shard under tensor parallelism) with its weights, built on the meta device and
        then materialized in the runner's dtype: a 70B shard would not fit on the device in fp32 first."""
        from .model.loader import fill_dummy

        tp = self.tp
        with torch.device("meta"):
            model = LlamaForCausalLM(self.cfg if tp is None else tp.local_config(self.cfg))
        model = model.to(self.dtype).to_empty(device=self.device)
        if tp is not None:
            tp.shard(model, self.cfg.vocab_size)
        model.tie_weights()  # to_empty and sharding replaced the parameters a tie shares
        if weights is None:
            fill_dummy(model, seed) if tp is None else tp.fill_dummy(model, self.cfg, seed)
        else:
            model.load_weights(weights(), select=None if tp is None else tp.selector(self.cfg.head_dim).select)
        return model

    def host_thread(self) -> None:
        """On the CPU, make the calling thread (the scheduler's) run its torch ops on itself alone, so that the
        device thread's are the engine's only OpenMP regions (module docstring); other threads keep their count."""
        if self.device.type == "cpu":
            threads = self.run_on_device(torch.get_num_threads)
            torch.get_num_threads()  # (torch sets a thread's count from the default at its first use: done here)
            torch.set_num_threads(1)  # this thread's, and the default of threads yet to run a torch op...
            self.run_on_device(torch.set_num_threads, threads)  # ...which the device thread sets back

    def run_on_device(self, fn, *args):
        """fn(*args) in the device's order, on its thread (the CPU's worker: see the module docstring)."""
        return self._work.submit(fn, *args).result()

    @property
    def failure(self) -> str | None:
        """Why this runner can run no more forwards (a failed tensor-parallel group), or None."""
        return None if self.tp is None else self.tp.failure

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Forwards over the dummy row (slot 0 only) in each shape class a step can take: decode of one and of
        several requests, and a prefill; each compiles (or loads from the disk cache) here, not in a request."""
        def t(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        for decode, n in ((True, 2), (True, 1), (False, 8)):
            ext = [1] * n if decode else [n]  # n requests of one token, or one request of n tokens
            b = len(ext)
            batch = ForwardBatch(
                is_decode=decode, rows=t([DUMMY_ROW] * b), prefix_lens=t([0] * b), extend_lens=t(ext),
                seq_lens=t(ext), extend_start=t(list(range(b)) if decode else [0]), max_extend_len=max(ext),
                max_seq_len=max(ext), positions=t([0] * n if decode else list(range(n))), out_slots=t([0] * n),
                logits_index=t(list(range(b)) if decode else [n - 1]), kv_cache=self.kv, req_to_token=self.table,
                attn=self.attn)
            self.attn.prepare(batch)
            self.step_model(t([0] * n), batch)

    def close(self) -> None:
        """Wait for the device work submitted so far, stop the tensor-parallel workers; drop the CUDA graphs, KV
        buffers, tables and weights (Engine.shutdown)."""
        self.run_on_device(lambda: None)  # the device thread runs in order: everything before has run
        if self.tp is not None:
            self.tp.close()
        self.graphs = self.kv = self.table = self.token_buf = self.model = self.step_model = None

    # ---- the step --------------------------------------------------------------------------------------------
    def run(self, sb: ScheduledBatch) -> StepOutput:
        """launch, sample and collect in one go (no overlap)."""
        h = self.launch(sb)
        self.sample(h, sb.reqs)
        return self.collect(h)

    def launch(self, sb: ScheduledBatch) -> Launch:
        ext, pre = sb.extend_lens, sb.prefix_lens
        starts = sb.extend_start
        sampled = [i for i, s in enumerate(sb.sample) if s]
        logit_pos = [starts[i] + ext[i] - 1 for i in sampled]
        spans = []  # prompt logprobs: position p predicts token p + 1, for tokens logprob_start .. logprob_end - 1
        for i in sb.logprob_reqs:
            r = sb.reqs[i]
            end = len(r.input_ids) if r.logprob_end is None else r.logprob_end
            lo, hi = max(pre[i], r.logprob_start - 1), min(pre[i] + ext[i], end - 1)
            if hi > lo:
                spans.append((i, lo, hi - lo))
                logit_pos.extend(range(starts[i] + lo - pre[i], starts[i] + hi - pre[i]))
        tw = sb.table_writes
        tw_rows, tw_cols = _table_write_index(tw)
        fb = sb.from_buffer
        ints = (ext + starts + [sb.rows[i] for i in sampled] + logit_pos + sb.input_ids + [sb.rows[i] for i in fb]
                + [starts[i] for i in fb])
        # Every new token's row, position and slot first: the [3, n] inputs of a CUDA graph's replay (cuda_graph.py).
        # A decode step's are its requests' rows and prefix lengths; an extend's are spelled out here, on the host,
        # so that its forward starts without index kernels (an extend is a chain's next call: latency).
        rows_pre = sb.rows + pre
        if sb.is_decode:  # (its rows and prefix lengths are those of its tokens: not sent twice)
            per_token, per_req = [rows_pre, sb.out_slots], []
        else:
            per_token, per_req = [*_spans_index(sb.rows, pre, ext), sb.out_slots], [rows_pre]
        n_tok, n_req = len(sb.out_slots), len(sb) if per_req else 0
        # one int64 array (numpy: a decode step's few parts without torch's per-op host cost)
        host = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in (
            *per_token, *per_req, ints, tw_rows, tw_cols, *[s for _, _, s in tw])]))
        sizes = [n_tok, n_tok, n_tok, n_req, n_req, len(sb), len(sb), len(sampled), len(logit_pos), len(sb.input_ids),
                 len(fb), len(fb), len(tw_rows), len(tw_cols), len(tw_rows)]
        shape = (sb.is_decode, max(ext), max(p + e for p, e in zip(pre, ext)), len(sb.out_slots), sb.shared_prefix)
        forward = self._forward if self.tp is None else partial(self.tp.run_step, self._forward)
        fut = self._work.submit(forward, host, sizes, shape)
        if sb.is_decode and sb.logprob_reqs and self.graphs is not None:
            # A replay's logits are the graph's buffer, which the next step's replay (launched before this step
            # is collected, under overlap) overwrites; sampling reads them before it, logprobs after.
            fut = self._work.submit(_own_logits, fut)
        return Launch(sb, sampled, spans, fut)

    @torch.inference_mode()
    def _forward(self, host: torch.Tensor, sizes: list[int], shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        is_decode, max_ext, max_seq, n_tok, shared = shape
        if self._pinned:
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)  # the step's one host-to-device copy
        (tok_rows, positions, slots, rows, pre, ext, starts, sample_rows, logit_pos, ids, fb_rows, fb_pos, tw_rows,
         tw_cols, tw_vals) = torch.split(dev, sizes)
        tokens = dev[:3 * n_tok].view(3, -1)  # each new token's row, position and slot (launch)
        if is_decode:
            rows, pre = tok_rows, positions
        if len(tw_rows):
            self.table[tw_rows, tw_cols] = tw_vals.to(torch.int32)
        if self.tp is not None and (is_decode or len(fb_rows)):
            self.tp.share_tokens(self.token_buf)  # only rank 0 samples: the others read its buffer
        if is_decode and self.graphs is not None and len(rows) <= self.graphs.max_bs:
            # the graph gathers the input ids and writes the slot table itself (cuda_graph.py)
            return self.graphs.replay(tokens, shared), sample_rows
        seq = pre + ext
        if is_decode:
            ids = self.token_buf[rows]
        else:
            if len(fb_rows):
                ids = ids.clone()
                ids[fb_pos] = self.token_buf[fb_rows]
            if self.graphs is not None and self.graphs.replays_extend(n_tok, max_seq):
                # one decode row per new token, in replays of at most a bucket's rows (cuda_graph.py); the logits
                # asked for are gathered out of the graphs' buffers, which the next replay overwrites
                return self.graphs.replay_extend(ids, tokens, logit_pos), sample_rows
        self.table[tok_rows, positions] = slots.to(torch.int32)
        batch = ForwardBatch(
            is_decode=is_decode, rows=rows, prefix_lens=pre, extend_lens=ext, seq_lens=seq, extend_start=starts,
            max_extend_len=max_ext, max_seq_len=max_seq, positions=positions, out_slots=slots,
            logits_index=logit_pos, kv_cache=self.kv, req_to_token=self.table, attn=self.attn, shared_prefix=shared)
        self.attn.prepare(batch)
        return self.step_model(ids, batch), sample_rows

    def sample(self, h: Launch, grammar_reqs: list) -> None:
        """Queue sampling of `h` after its forward. `grammar_reqs[i]`: the request whose grammar masks row i, or
        None (no grammar, or an entry gone stale whose matcher has moved on)."""
        if h.sampled:
            h.tokens = self._work.submit(self._sample, h, [grammar_reqs[i] for i in h.sampled])

    @torch.inference_mode()
    def _sample(self, h: Launch, grammar_reqs: list):
        logits, sample_rows = h.forward.result()
        n = len(h.sampled)
        # Logprobs report the raw distribution: keep the raw rows when someone asks (masks apply in place).
        x = logits[:n].clone() if h.sb.logprob_reqs else logits[:n]
        reqs = [h.sb.reqs[i] for i in h.sampled]
        apply_grammar_masks(x, grammar_reqs, self.cfg.vocab_size)
        next_ids = sample(x, reqs, self.cfg.eos_token_ids)
        self.token_buf[sample_rows] = next_ids
        if not self._pinned:
            return next_ids, None
        out = torch.empty(n, dtype=next_ids.dtype, pin_memory=True)
        out.copy_(next_ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        return out, done

    def wait(self, h: Launch) -> None:
        """Wait until h's device work has run, ignoring its errors (its results will not be used)."""
        for fut in (h.forward, h.tokens):
            if fut is not None:
                fut.exception()
        if self._pinned:
            self._stream.synchronize()

    def check_table(self, host: torch.Tensor, spans: list[tuple[int, int, list[tuple[int, int]]]]) -> None:
        """Assert that the device slot table equals the scheduler's `host` copy, once the device work launched so far
        has run, over each (row, n, skip) span's positions [0, n) outside skip's [lo, hi) ranges."""
        if not spans:
            return
        rows = [row for row, _, _ in spans]
        n = max(n for _, n, _ in spans)
        dev = self.run_on_device(lambda: self.table[torch.tensor(rows, device=self.device), :n].cpu())
        for i, (row, k, skip) in enumerate(spans):
            differs = dev[i, :k] != host[row, :k]
            for lo, hi in skip:
                differs[lo:hi] = False
            if differs.any():
                raise AssertionError(f"the device slot table's row {row} differs from the host's at positions "
                                     f"{differs.nonzero().flatten()[:8].tolist()}")

    def collect(self, h: Launch) -> StepOutput:
        logits, _ = h.forward.result()
        n = len(h.sb)
        next_ids: list[int | None] = [None] * n
        if h.tokens is not None:
            ids, done = h.tokens.result()
            if done is not None:
                done.synchronize()
            for i, t in zip(h.sampled, ids.tolist()):
                next_ids[i] = t
        out = StepOutput(next_ids, [None] * n, [[] for _ in range(n)])
        if h.sb.logprob_reqs:
            self.run_on_device(self._logprobs, h, logits, out)
        return out

    @torch.inference_mode()
    def _logprobs(self, h: Launch, logits: torch.Tensor, out: StepOutput) -> None:
        """Logprobs of the prompt and sampled tokens of the requests that asked: one log-softmax, one gather and
        one top-k over just their rows."""
        sb, rows, targets = h.sb, [], []
        at = {i: j for j, i in enumerate(h.sampled)}
        want = [i for i in sb.logprob_reqs if i in at]
        for i in want:
            rows.append(at[i])
            targets.append(out.next_ids[i])
        base = len(h.sampled)
        for i, first, count in h.spans:
            rows.extend(range(base, base + count))
            targets.extend(sb.reqs[i].input_ids[first + 1:first + 1 + count])
            base += count
        if not rows:
            return
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        top_n = max(sb.reqs[i].params.top_logprobs_num for i in sb.logprob_reqs)
        chosen, tops = token_logprobs(logprobs, torch.tensor(targets, device=logits.device), top_n)
        for j, i in enumerate(want):
            p = sb.reqs[i].params
            by_id = None if p.token_ids_logprob is None else list(zip(logprobs[j, p.token_ids_logprob].tolist(),
                                                                      p.token_ids_logprob))
            out.out_logprobs[i] = (chosen[j], tops[j][:p.top_logprobs_num], by_id)
        j = len(want)
        for i, first, count in h.spans:
            n_top = sb.reqs[i].params.top_logprobs_num
            out.in_logprobs[i] = [(first + 1 + m, chosen[j + m], tops[j + m][:n_top]) for m in range(count)]
            j += count
