"""Triton attention kernels over a token-granular (page_size 1) KV pool.

Layout shared by both entry points:

- ``k_buf`` / ``v_buf``: one layer's KV pool, ``[num_slots, H_kv, D]``. Slot 0 is
  a dummy slot; the kernels never read a slot that ``req_to_token`` does not map
  from a position inside a request's length.
- ``req_to_token``: int32 ``[num_rows, max_context]``; ``req_to_token[r, p]`` is
  the KV slot of position ``p`` of the request in row ``r``. Entries beyond a
  request's length may hold anything.
- ``rows``: ``[B]`` request rows into ``req_to_token``.

Query head ``h`` reads KV head ``h // (H_q // H_kv)`` (GQA/MQA). Softmax is
computed online (flash-attention style) in fp32, in the log2 domain so the
inner loop uses ``exp2``.
"""

import torch
import triton
import triton.language as tl

from ..kernels.launch import grid_dependency, pdl_args

_LOG2E = 1.4426950408889634

# Decode split-K sizing: aim for about two waves over an H200's 132 SMs, never
# split finer than one key block, and cap the split count to bound the scratch
# buffer and the stage-2 reduction.
_H200_SMS = 132
_DECODE_TARGET_PROGRAMS = 2 * _H200_SMS
_DECODE_MAX_SPLITS = 64
# Query heads of one KV group are padded to 16 rows, the smallest M that tl.dot
# accepts on tensor cores.
_DECODE_MIN_BLOCK_H = 16


def _extend_config(row_bytes: int, max_extend_len: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a K/V row of ``row_bytes``.

    Extends of at most 64 tokens (a program's few new tokens on a long cached prefix) take 64-row query tiles
    whatever the row: 128-row tiles would leave half of every tile padding.

    Measured on an H200 (bf16, 32 q / 8 kv heads, one causal 4k-16k chunk):
    for D=64, 64x64 tiles with 4 warps ran at 290-330 TFLOP/s (8 warps: <230);
    for D=128, 128x128 tiles with 8 warps at 340-380 TFLOP/s, against 200-350
    for 128x64 or 64x64 tiles. Wider rows (fp32 D=128, D > 128) get small tiles
    so that q and the pipelined K/V tiles still fit in shared memory.
    """
    if row_bytes <= 128 or (max_extend_len <= 64 and row_bytes <= 256):
        return 64, 64, 4, 3
    if row_bytes <= 256:
        return 128, 128, 8, 3
    return 64, 32, 4, 2


def _decode_block_n(row_bytes: int) -> int:
    # K and V tiles of up to 32 KiB: 128 keys for bf16 D=128, which measured
    # best on an H200 (3.4-4.1 TB/s of KV for one request of 32k-128k tokens);
    # fewer keys for wider rows so two pipeline stages fit in shared memory.
    return min(128, max(16, 32768 // row_bytes))


def _decode_config(programs: int, row_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of decode stage 1 for `programs` = batch x KV heads.

    Batched decode (at least one program per SM before splitting): 32-key tiles, 2 warps, which let several
    programs share an SM. Measured on the H200 at 272 tokens of context (benchmarks/gpu_attention_sweep.py,
    results/h200_probe/attention_sweep.json), per layer: llama-2-7b batch 64 77 us against 87 with 128-key tiles
    (floor 67), batch 256 281 against 302 (floor 266); llama-3-8b batch 256 83 against 94. Fewer programs (a
    handful of long requests, split over the context) keep the large tiles of _decode_block_n."""
    if programs >= _H200_SMS:
        return 32, 2, 2
    return _decode_block_n(row_bytes), 4, 2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b, fp32 operands (IEEE) in full precision as torch's fp32 attention computes (Triton's default for them
    is tf32, ~5e-3 off): an fp32 engine on the GPU then agrees with transformers in fp32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one block of log2-scaled, already-masked scores ``qk`` [M, N] and
    values ``v`` [N, D] into the running max ``m_i``, sum ``l_i`` and ``acc``."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Every row sees at least one unmasked key in its first block, so m_new is
    # finite from then on and these exponents never produce NaN.
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _attend_key_range(q, K, V, slot_row, kv_h, start, end, m_i, l_i, acc, qk_scale, offs_n, offs_d, d_mask,
                      stride_kn, stride_kh, stride_vn, stride_vh, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Fold keys [start, end) of KV head kv_h (slots from the table row `slot_row`) into the online softmax of the
    query tile q [M, D], BLOCK_N keys a step, the last step masked: the decode kernels' key loop."""
    for n_start in range(start, end, BLOCK_N):
        k_pos = n_start + offs_n
        n_mask = k_pos < end
        slots = tl.load(slot_row + k_pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_h * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_vn + kv_h * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = _dot(q, tl.trans(k), IEEE) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE)
    return m_i, l_i, acc


@triton.jit
def _extend_kernel(
    Q, K, V, O, ReqToToken, Rows, PrefixLens, ExtendLens, ExtendStart,
    qk_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_ot, stride_oh, stride_req,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(ExtendLens + b)
    if m_start >= extend_len:
        return
    prefix_len = tl.load(PrefixLens + b)
    q_start = tl.load(ExtendStart + b).to(tl.int64)
    slot_row = ReqToToken + tl.load(Rows + b).to(tl.int64) * stride_req
    kv_h = h // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < extend_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )
    q_pos = prefix_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys before this block's first query are visible to every query in it, so
    # whole key blocks there need neither a causal nor a bounds mask.
    full_end = (prefix_len + m_start) // BLOCK_N * BLOCK_N
    for n_start in range(0, full_end, BLOCK_N):
        slots = tl.load(slot_row + n_start + offs_n).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_kn + kv_h * stride_kh + offs_d[None, :],
                    mask=d_mask[None, :], other=0.0)
        v = tl.load(V + slots[:, None] * stride_vn + kv_h * stride_vh + offs_d[None, :],
                    mask=d_mask[None, :], other=0.0)
        qk = _dot(q, tl.trans(k), IEEE) * qk_scale
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE)

    # The rest, up to this block's last real query, straddles the diagonal.
    kv_end = prefix_len + tl.minimum(m_start + BLOCK_M, extend_len)
    for n_start in range(full_end, kv_end, BLOCK_N):
        k_pos = n_start + offs_n
        n_mask = k_pos < kv_end
        slots = tl.load(slot_row + k_pos, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + slots[:, None] * stride_kn + kv_h * stride_kh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(V + slots[:, None] * stride_vn + kv_h * stride_vh + offs_d[None, :],
                    mask=kv_mask, other=0.0)
        qk = _dot(q, tl.trans(k), IEEE) * qk_scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE)

    out = acc / l_i[:, None]
    tl.store(
        O + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


@triton.jit
def _split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per decode split: a whole number of key blocks, so that only a
    split's last block can be partial. Trailing splits may be empty."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_stage1_kernel(
    Q, K, V, ReqToToken, Rows, SeqLens, PartAcc, PartLse, O,
    qk_scale, kv_start, KvStartPtr,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_req,
    stride_pab, stride_pah, stride_pas, stride_plb, stride_plh, stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_PREFIX: tl.constexpr,
    PREFIX_PTR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """Keys [kv_start, seq_len) of each request, split NUM_SPLITS ways; kv_start > 0 when a shared prefix's keys
    [0, kv_start) are _decode_prefix_kernel's (HAS_PREFIX: their partials follow the splits, stage 2 merges).
    PREFIX_PTR (CUDA graphs): kv_start is read from the device int KvStartPtr instead."""
    grid_dependency(PDL)
    b = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    if HAS_PREFIX:
        if PREFIX_PTR:
            kv_start = tl.load(KvStartPtr)
        split_len = _split_len(seq_len - kv_start, NUM_SPLITS, BLOCK_N)
        start = kv_start + split * split_len
    else:  # the kernel as before the cascade: splits start at multiples of BLOCK_N, which the compiler can see
        # (measured on the H200: with a runtime kv_start of 0, batch-64 decode attention took 5% longer)
        split_len = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
        start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:
        return  # stage 2 recomputes which splits are empty and skips them
    slot_row = ReqToToken + tl.load(Rows + b).to(tl.int64) * stride_req

    # All query heads of this KV group share one program, so each K/V tile is
    # loaded once per group; rows past GROUP are padding and never stored.
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_h * GROUP + offs_h
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_key_range(q, K, V, slot_row, kv_h, start, end, m_i, l_i, acc, qk_scale, offs_n, offs_d,
                                      d_mask, stride_kn, stride_kh, stride_vn, stride_vh, BLOCK_N, IEEE)

    if NUM_SPLITS == 1 and not HAS_PREFIX:  # the whole sequence: the output itself, and no stage 2
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(O.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # Store the split's normalized output and its log2-sum-exp; stage 2
        # reweights splits by exp2(lse - max lse).
        tl.store(
            PartAcc + b * stride_pab + heads[:, None] * stride_pah + split * stride_pas + offs_d[None, :],
            acc / l_i[:, None],
            mask=h_mask[:, None] & d_mask[None, :],
        )
        tl.store(PartLse + b * stride_plb + heads * stride_plh + split, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit
def _decode_prefix_kernel(
    Q, K, V, ReqToToken, Rows, PartAcc, PartLse,
    qk_scale, prefix_len, PrefixLenPtr, num_q_rows,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_req,
    stride_pab, stride_pah, stride_pas, stride_plb, stride_plh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
    PREFIX_PTR: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, PDL: tl.constexpr,
):
    """The keys [0, prefix_len) that every request of the batch shares slot for slot: program (t, kv_h, split)
    takes BLOCK_Q of the batch's B x GROUP query rows of KV head kv_h (row r: request r // GROUP, head
    kv_h GROUP + r % GROUP) against split `split` of the prefix, so each K/V tile is read once per BLOCK_Q
    queries of the whole batch instead of once per request. Its normalized partial and log2-sum-exp go to
    split NUM_SPLITS + split of the stage-1 scratch; stage 2 merges them with the requests' own keys."""
    grid_dependency(PDL)
    t = tl.program_id(0)
    kv_h = tl.program_id(1)
    split = tl.program_id(2)
    if PREFIX_PTR:  # 0 there (a graph's capture): every program returns
        prefix_len = tl.load(PrefixLenPtr)
    split_len = _split_len(prefix_len, PREFIX_SPLITS, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)
    if start >= end:
        return  # stage 2 skips it the same way
    slot_row = ReqToToken + tl.load(Rows).to(tl.int64) * stride_req  # any row: they agree on the prefix

    offs_r = t * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    r_mask = offs_r < num_q_rows
    d_mask = offs_d < HEAD_DIM
    req = (offs_r // GROUP).to(tl.int64)
    heads = kv_h * GROUP + offs_r % GROUP
    q_mask = r_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + req[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_key_range(q, K, V, slot_row, kv_h, start, end, m_i, l_i, acc, qk_scale, offs_n, offs_d,
                                      d_mask, stride_kn, stride_kh, stride_vn, stride_vh, BLOCK_N, IEEE)

    s = NUM_SPLITS + split
    tl.store(PartAcc + req[:, None] * stride_pab + heads[:, None] * stride_pah + s * stride_pas + offs_d[None, :],
             acc / l_i[:, None], mask=q_mask)
    tl.store(PartLse + req * stride_plb + heads * stride_plh + s, m_i + tl.log2(l_i), mask=r_mask)


@triton.jit
def _decode_stage2_kernel(
    PartAcc, PartLse, O, SeqLens, kv_start, KvStartPtr,
    stride_pab, stride_pah, stride_pas, stride_plb, stride_plh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PREFIX_SPLITS: tl.constexpr, PREFIX_PTR: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, PREFIX_BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merges request b's NUM_SPLITS stage-1 splits of keys [kv_start, seq_len) and the PREFIX_SPLITS splits of
    the shared prefix [0, kv_start) that follow them (none without a shared prefix)."""
    grid_dependency(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    if PREFIX_SPLITS > 0:
        if PREFIX_PTR:
            kv_start = tl.load(KvStartPtr)
        seq_len -= kv_start
    split_len = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # Empty splits were never written: mask them out instead of reading scratch.
    s_mask = (offs_s < NUM_SPLITS) & (offs_s * split_len < seq_len)
    if PREFIX_SPLITS > 0:
        prefix_split_len = _split_len(kv_start, PREFIX_SPLITS, PREFIX_BLOCK_N)
        p = offs_s - NUM_SPLITS
        s_mask = s_mask | ((p >= 0) & (p < PREFIX_SPLITS) & (p * prefix_split_len < kv_start))
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(PartLse + b * stride_plb + h * stride_plh + offs_s, mask=s_mask, other=float("-inf"))
    part = tl.load(
        PartAcc + b * stride_pab + h * stride_pah + offs_s[:, None] * stride_pas + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )
    weight = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_mask)


def _check_inputs(q, k_buf, v_buf, req_to_token):
    assert q.dtype == k_buf.dtype == v_buf.dtype, "q, k_buf and v_buf must share a dtype"
    assert q.shape[-1] == k_buf.shape[-1] == v_buf.shape[-1], "head dims differ"
    assert k_buf.shape[1] == v_buf.shape[1] and q.shape[1] % k_buf.shape[1] == 0, "bad GQA head counts"
    for t in (q, k_buf, v_buf, req_to_token):
        assert t.stride(-1) == 1, "innermost dimension must be contiguous"


def _block_d(head_dim: int) -> int:
    # tl.dot needs every tile dimension >= 16.
    return max(16, triton.next_power_of_2(head_dim))


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_start: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention for a batch of extend (prefill) chunks.

    Shapes:
        q: [T, H_q, D], T = sum(extend_lens); request b's queries are
            q[extend_start[b] : extend_start[b] + extend_lens[b]], at absolute
            positions prefix_lens[b] + i.
        k_buf, v_buf: [num_slots, H_kv, D], same dtype as q; H_q % H_kv == 0.
        req_to_token: int32 [num_rows, max_context].
        rows, prefix_lens, extend_lens, extend_start: integer [B], on q's device.
        max_extend_len: Python int >= max(extend_lens); sizes the grid only.
    Invariants:
        The new tokens' K/V are already in k_buf/v_buf at slots
        req_to_token[rows[b], prefix_lens[b] : prefix_lens[b] + extend_lens[b]],
        and prefix_lens[b] + extend_lens[b] <= max_context.
        Query i of request b attends to positions 0 .. prefix_lens[b] + i.
    Returns:
        [T, H_q, D] in q's dtype (rows of q not covered by any request are
        left uninitialized).
    """
    _check_inputs(q, k_buf, v_buf, req_to_token)
    num_heads, head_dim = q.shape[1:]
    block_d = _block_d(head_dim)
    block_m, block_n, num_warps, num_stages = _extend_config(block_d * q.element_size(), max_extend_len)
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    grid = (rows.shape[0], num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q, k_buf, v_buf, o, req_to_token, rows, prefix_lens, extend_lens, extend_start,
        sm_scale * _LOG2E,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        o.stride(0), o.stride(1), req_to_token.stride(0),
        GROUP=num_heads // k_buf.shape[1], HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages, **pdl_args(q),
    )
    return o


def _prefix_splits(q_tiles: int, num_kv_heads: int, prefix_len: int, block_n: int) -> int:
    """Splits of the shared prefix: about two waves of programs, never finer than one key block."""
    return max(1, min(triton.cdiv(_DECODE_TARGET_PROGRAMS, q_tiles * num_kv_heads), triton.cdiv(prefix_len, block_n),
                      _DECODE_MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    max_seq_len: int | None = None,
    config: tuple[int, int, int] | None = None,
    shared_prefix: int = 0,
) -> torch.Tensor:
    """Single-token decode attention, flash-decoding style (split-K).

    Shapes:
        q: [B, H_q, D]; query b sits at position seq_lens[b] - 1.
        k_buf, v_buf: [num_slots, H_kv, D], same dtype as q; H_q % H_kv == 0.
        req_to_token: int32 [num_rows, max_context].
        rows, seq_lens: integer [B], on q's device.
        max_seq_len: Python int >= max(seq_lens), used only to choose the
            number of KV splits; None means req_to_token.shape[1], which keeps
            the launch shape independent of the batch's lengths (CUDA graphs).
        config: (BLOCK_N, num_warps, num_stages) of stage 1; None: _decode_config.
        shared_prefix: P: positions [0, P) hold the same slots in every row
            of `rows` (a prefix the batch shares in the radix cache), and
            P < seq_lens[b] for every b. 0: nothing assumed. A Python int, or
            an int32 [1] device tensor (CUDA graphs: the launch is sized for
            any P below max_seq_len, the length read on the device; 0 there
            turns the prefix kernel's programs into no-ops).
    Invariants:
        1 <= seq_lens[b] <= max_context, and the query's own K/V is already
        written at slot req_to_token[rows[b], seq_lens[b] - 1].
    Returns:
        [B, H_q, D] in q's dtype.

    Stage 1 runs one program per (request, KV head, split): it loads each K/V
    tile once for all query heads of the group and writes that split's
    normalized output and log-sum-exp to fp32 scratch. Stage 2 merges the
    splits per (request, query head). With one split (a batch of enough
    requests to fill the GPU unsplit) stage 1 writes the output and stage 2
    does not run. With a shared prefix, stage 1 covers each request's own keys
    [P, seq_len) only, and _decode_prefix_kernel the prefix, once for the
    whole batch (the cascade: a 1,200-token prompt shared by 128 requests is
    read once a layer instead of 128 times); stage 2 merges both.
    """
    _check_inputs(q, k_buf, v_buf, req_to_token)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_buf.shape[1]
    group = num_heads // num_kv_heads
    block_d = _block_d(head_dim)
    row_bytes = block_d * q.element_size()
    block_n, num_warps, num_stages = config or _decode_config(batch * num_kv_heads, row_bytes)
    if max_seq_len is None:
        max_seq_len = req_to_token.shape[1]
    on_device = isinstance(shared_prefix, torch.Tensor)
    if not on_device and not 0 <= shared_prefix < max_seq_len:
        raise ValueError(f"shared_prefix must be in [0, max_seq_len = {max_seq_len}), got {shared_prefix}")
    longest_prefix = max_seq_len - 1 if on_device else shared_prefix  # what the launch must cover
    # The kernels take the length as an int and, read instead where PREFIX_PTR, a pointer (seq_lens: unread).
    prefix_arg, prefix_ptr = (0, shared_prefix) if on_device else (shared_prefix, seq_lens)
    num_splits = max(1, min(
        triton.cdiv(_DECODE_TARGET_PROGRAMS, max(1, batch * num_kv_heads)),
        triton.cdiv(max_seq_len - (0 if on_device else shared_prefix), block_n),
        _DECODE_MAX_SPLITS,
    ))
    if longest_prefix:
        q_rows = batch * group
        block_q, prefix_block_n, prefix_warps, prefix_stages = _extend_config(row_bytes, q_rows)
        q_tiles = triton.cdiv(q_rows, block_q)
        prefix_splits = _prefix_splits(q_tiles, num_kv_heads, longest_prefix, prefix_block_n)
    else:
        prefix_splits, prefix_block_n = 0, block_n
    parts = num_splits + prefix_splits

    o = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if parts > 1:
        part_acc = torch.empty((batch, num_heads, parts, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, parts), dtype=torch.float32, device=q.device)
    else:  # stage 1 writes o itself (batched decode: enough programs without splitting)
        part_acc, part_lse = o.unsqueeze(2), o[:, :, 0]  # unused: stand-ins with the right number of strides

    if prefix_splits:
        _decode_prefix_kernel[(q_tiles, num_kv_heads, prefix_splits)](
            q, k_buf, v_buf, req_to_token, rows, part_acc, part_lse,
            sm_scale * _LOG2E, prefix_arg, prefix_ptr, q_rows,
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
            req_to_token.stride(0),
            part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_lse.stride(0), part_lse.stride(1),
            GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, PREFIX_SPLITS=prefix_splits,
            PREFIX_PTR=on_device, BLOCK_Q=block_q, BLOCK_N=prefix_block_n, BLOCK_D=block_d, IEEE=q.dtype == torch.float32,
            num_warps=prefix_warps, num_stages=prefix_stages, **pdl_args(q),
        )
    _decode_stage1_kernel[(batch, num_kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_token, rows, seq_lens, part_acc, part_lse, o,
        sm_scale * _LOG2E, prefix_arg, prefix_ptr,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_lse.stride(0), part_lse.stride(1),
        o.stride(0), o.stride(1),
        GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, HAS_PREFIX=prefix_splits > 0, PREFIX_PTR=on_device,
        BLOCK_H=max(_DECODE_MIN_BLOCK_H, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_D=block_d, IEEE=q.dtype == torch.float32, num_warps=num_warps,
        num_stages=num_stages, **pdl_args(q),
    )
    if parts == 1:
        return o
    _decode_stage2_kernel[(batch, num_heads)](
        part_acc, part_lse, o, seq_lens, prefix_arg, prefix_ptr,
        part_acc.stride(0), part_acc.stride(1), part_acc.stride(2), part_lse.stride(0), part_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, PREFIX_SPLITS=prefix_splits, PREFIX_PTR=on_device,
        BLOCK_S=triton.next_power_of_2(parts), BLOCK_N=block_n, PREFIX_BLOCK_N=prefix_block_n, BLOCK_D=block_d,
        num_warps=4, **pdl_args(q),
    )
    return o
