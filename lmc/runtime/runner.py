"""ModelRunner: owns the model, the KV memory and the attention backend; turns a scheduled batch into one
forward, then samples and extracts logprobs. It knows nothing of queues or the radix tree."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import ForwardBatch, make_backend
from .core import Req
from .grammar import apply_grammar_masks
from .memory import KVCache, ReqToTokenPool, SlotAllocator
from .model.linear import prepack_linears
from .model.llama import LlamaForCausalLM, ModelConfig, rope_cos_sin
from .sampling import sample, token_logprobs


@dataclass
class ScheduledBatch:
    """What the scheduler decided for one forward. Slots for the new tokens are already allocated and written
    into each request's row of the slot table."""

    reqs: list[Req]
    is_decode: bool
    prefix_lens: list[int]
    extend_lens: list[int]
    out_slots: torch.Tensor  # CPU int64 [T]
    sample: list[bool]  # does the request sample a token in this forward (false for a non-final chunk)


@dataclass
class StepOutput:
    next_ids: list[int | None] = field(default_factory=list)
    # per request: (logprob, top) of the sampled token, and [(position, logprob, top)] for prompt tokens
    out_logprobs: list = field(default_factory=list)
    in_logprobs: list = field(default_factory=list)


def _tokens(r: Req, lo: int, hi: int) -> list[int]:
    """r.fill_ids[lo:hi] without building fill_ids (a decode step would copy the whole sequence per request)."""
    n = len(r.input_ids)
    if lo >= n:
        return r.output_ids[lo - n:hi - n]
    return r.input_ids[lo:hi] + r.output_ids[:max(0, hi - n)]


class ModelRunner:
    def __init__(self, hf_config, weights, *, device: torch.device, dtype: torch.dtype, attention: str,
                 max_total_tokens: int, max_running: int, context_length: int, seed: int = 0,
                 mem_fraction: float = 0.85, cuda_graph_max_bs: int = 256, enable_torch_compile: bool = False):
        """`enable_torch_compile`: run forwards that are not CUDA-graph replays through torch.compile (compiled.py),
        compiling at construction (a warm-up forward per shape class) so no request waits for it."""
        from .model.loader import fill_dummy

        self.cfg = ModelConfig.from_hf(hf_config)
        self.device, self.dtype = device, dtype
        self.context_length = context_length
        with torch.device(device):
            model = LlamaForCausalLM(self.cfg)
        model.to(dtype)
        if weights is None:
            fill_dummy(model, seed)
        else:
            model.load_weights(weights())
        prepack_linears(model)  # CPU fp32: weights into oneDNN's blocked layout (linear.py)
        self.model = model.eval()
        self.model.rope = rope_cos_sin(hf_config, context_length, device, dtype)
        self.attn = make_backend(attention, device)
        c = self.cfg
        if not max_total_tokens:  # size the pool from what the device has left (GPU only)
            free, total = torch.cuda.mem_get_info(device)
            budget = free - (1 - mem_fraction) * total
            max_total_tokens = int(budget // KVCache.bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, dtype))
            if max_total_tokens < context_length:
                raise RuntimeError(f"only {max_total_tokens} KV tokens fit on {device}; lower the context length")
        self.kv = KVCache(c.num_layers, max_total_tokens, c.num_kv_heads, c.head_dim, dtype, device)
        # One row more than can ever run: the last row stays all-zero (dummy slot 0) for CUDA-graph padding.
        self.req_pool = ReqToTokenPool(max_running + 2, context_length, device)
        self.dummy_row = self.req_pool.alloc()
        self.allocator = SlotAllocator(max_total_tokens)
        self.step_model = model
        if enable_torch_compile:
            from .compiled import CompiledForward

            self.step_model = CompiledForward(model)
            self._warm_up()
        self.graphs = None
        if cuda_graph_max_bs and device.type == "cuda" and getattr(self.attn, "graph_safe", False):
            from .cuda_graph import DecodeGraphs

            self.graphs = DecodeGraphs(self, min(cuda_graph_max_bs, max_running))

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
                is_decode=decode, rows=t([self.dummy_row] * b), prefix_lens=t([0] * b), extend_lens=t(ext),
                seq_lens=t(ext), extend_start=t(list(range(b)) if decode else [0]), max_extend_len=max(ext),
                max_seq_len=max(ext), positions=t([0] * n if decode else list(range(n))), out_slots=t([0] * n),
                logits_index=t(list(range(b)) if decode else [n - 1]), kv_cache=self.kv,
                req_to_token=self.req_pool.table, attn=self.attn)
            self.attn.prepare(batch)
            self.step_model(t([0] * n), batch)

    def reset_memory(self) -> None:
        """Mark every row and slot free (KV contents are simply overwritten later)."""
        self.req_pool.reset()
        self.dummy_row = self.req_pool.alloc()
        self.allocator = SlotAllocator(self.allocator.num_slots)

    def close(self) -> None:
        """Drop the CUDA graphs, KV buffers, slot table and weights (Engine.shutdown); unusable afterwards."""
        self.graphs = self.kv = self.req_pool = self.model = None

    def run(self, sb: ScheduledBatch) -> StepOutput:
        logits, prompt_rows = self.forward(sb)
        return self._postprocess(sb, logits, prompt_rows)

    @torch.inference_mode()
    def forward(self, sb: ScheduledBatch) -> tuple[torch.Tensor, list[list[int]]]:
        """Raw fp32 logits for, per request in order, its prompt-logprob positions then (if it samples) its last
        position; and, per request, the logits rows of its prompt positions."""
        reqs, dev = sb.reqs, self.device
        ids, positions, logit_pos, starts = [], [], [], []
        prompt_rows: list[list[int]] = []  # per request: row numbers in the logits of its prompt positions
        for r, pre, ext, smp in zip(reqs, sb.prefix_lens, sb.extend_lens, sb.sample):
            start = len(ids)
            starts.append(start)
            ids.extend(_tokens(r, pre, pre + ext))
            positions.extend(range(pre, pre + ext))
            # Position p predicts token p + 1; prompt logprobs cover tokens logprob_start .. len(input) - 1.
            lo, hi = max(pre, r.logprob_start - 1), min(pre + ext, len(r.input_ids) - 1)
            rows = []
            for p in range(lo, hi):
                rows.append(len(logit_pos))
                logit_pos.append(start + p - pre)
            prompt_rows.append(rows)
            if smp:
                logit_pos.append(start + ext - 1)
        seq_lens = [p + e for p, e in zip(sb.prefix_lens, sb.extend_lens)]
        rows = [r.row for r in reqs]
        if sb.is_decode and self.graphs is not None and len(reqs) <= self.graphs.max_bs:
            return self.graphs.replay(ids, positions, sb.out_slots, rows, seq_lens), prompt_rows
        to = dict(device=dev, non_blocking=True)
        batch = ForwardBatch(
            is_decode=sb.is_decode, rows=torch.tensor(rows).to(**to),
            prefix_lens=torch.tensor(sb.prefix_lens).to(**to), extend_lens=torch.tensor(sb.extend_lens).to(**to),
            seq_lens=torch.tensor(seq_lens).to(**to), extend_start=torch.tensor(starts).to(**to),
            max_extend_len=max(sb.extend_lens), max_seq_len=max(seq_lens), positions=torch.tensor(positions).to(**to),
            out_slots=sb.out_slots.to(**to), logits_index=torch.tensor(logit_pos, dtype=torch.long).to(**to),
            kv_cache=self.kv, req_to_token=self.req_pool.table, attn=self.attn)
        self.attn.prepare(batch)
        return self.step_model(torch.tensor(ids).to(**to), batch), prompt_rows

    @torch.inference_mode()
    def _postprocess(self, sb: ScheduledBatch, logits: torch.Tensor, prompt_rows: list[list[int]]) -> StepOutput:
        reqs, n = sb.reqs, len(sb.reqs)
        # logits rows are ordered request by request: its prompt rows, then its sampling row.
        sample_at: list[int | None] = []
        k = 0
        for rows, smp in zip(prompt_rows, sb.sample):
            k += len(rows)
            sample_at.append(k if smp else None)
            k += smp
        samplers = [i for i in range(n) if sample_at[i] is not None]
        next_ids: list[int | None] = [None] * n
        if samplers:
            # advanced indexing copies, so the grammar mask and the penalties applied in place leave `logits` raw
            rows_logits, rows_reqs = logits[[sample_at[i] for i in samplers]], [reqs[i] for i in samplers]
            apply_grammar_masks(rows_logits, rows_reqs, self.cfg.vocab_size)
            for i, t in zip(samplers, sample(rows_logits, rows_reqs, self.cfg.eos_token_ids).tolist()):
                next_ids[i] = t
        out = StepOutput(next_ids, [None] * n, [[] for _ in range(n)])
        want = [i for i in range(n) if reqs[i].params.return_logprob]
        if want:
            self._logprobs(sb, logits, prompt_rows, sample_at, next_ids, want, out)
        return out

    def _logprobs(self, sb: ScheduledBatch, logits: torch.Tensor, prompt_rows: list[list[int]],
                  sample_at: list[int | None], next_ids: list[int | None], want: list[int], out: StepOutput) -> None:
        """Logprobs of the prompt and sampled tokens of the requests in `want` (the ones that asked): one
        log-softmax, one gather and one top-k over just their rows."""
        rows, targets, spans = [], [], []  # spans: per wanted request, (first prompt position, #prompt, sampled?)
        for i in want:
            r, p_rows = sb.reqs[i], prompt_rows[i]
            first = max(sb.prefix_lens[i], r.logprob_start - 1)
            rows += p_rows
            targets += r.input_ids[first + 1:first + 1 + len(p_rows)]
            if sample_at[i] is not None:
                rows.append(sample_at[i])
                targets.append(next_ids[i])
            spans.append((first, len(p_rows), sample_at[i] is not None))
        if not rows:
            return
        logprobs = torch.log_softmax(logits[rows], dim=-1)
        top_n = max(sb.reqs[i].params.top_logprobs_num for i in want)
        chosen, tops = token_logprobs(logprobs, torch.tensor(targets, device=logits.device), top_n)
        j = 0
        for i, (first, n_prompt, sampled) in zip(want, spans):
            r = sb.reqs[i]
            n_top = r.params.top_logprobs_num
            if n_prompt:
                out.in_logprobs[i] = [(first + 1 + m, chosen[j + m], tops[j + m][:n_top]) for m in range(n_prompt)]
            j += n_prompt
            if sampled:
                ids = r.params.token_ids_logprob
                by_id = None if ids is None else list(zip(logprobs[j, ids].tolist(), ids))
                out.out_logprobs[i] = (chosen[j], tops[j][:n_top], by_id)
                j += 1
