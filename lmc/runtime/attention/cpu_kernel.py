"""The C++ CPU kernels, built once with torch's extension builder and cached on disk under the lmc cache dir
(`$LMC_CACHE_DIR/torch_extensions`, one directory per torch installation): later starts load the built library in a few seconds (`TORCH_EXTENSIONS_DIR`
overrides the place). One library (`torch.ops.lmc_cpu`), so a first start compiles once.

`paged_attention(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, extend_start, scale)` computes, for
every new token t of request b (flat index extend_start[b] + i, absolute position prefix_lens[b] + i), causal
attention over keys 0..position read at slots table[rows[b], j]. Work items are (token, kv head): the K and V rows
of a slot are loaded once for all query heads of the group (GQA). Scores go to a per-item buffer, then a two-pass
softmax in fp32 (as transformers' eager attention, so logprobs match it). No K/V is copied.

The decoder layer's elementwise ops, computed in fp32, each one pass instead of the torch reference's 5-8 ops
(kernels/reference.py has their definitions; kernels/__init__.py dispatches to these on the CPU): `rms_norm`,
`add_rms_norm`, `silu_mul` and `rope_q_write_kv` (RoPE of q and k, with k and v written into the KV cache); and
the greedy sampler's `argmax_rows` (sampling.py). The activations a linear writes (add_rms_norm's x, silu_mul's and
rope_q_write_kv's input) may be bf16, the output of the bf16 linears of `Engine(dtype="bfloat16")` (model/linear.py):
they widen exactly, and the outputs that feed a linear (the norm, silu_mul's product) leave in the input's dtype,
rounded as the linear would round them, so no fp32 copy of a bf16 activation is made and the numbers are those of
fp32 activations rounded at each linear's input.

On AVX-512 and AVX2 CPUs, a GEMM for the linears (`pack_panels`, `panel_linear`; model/linear.py): weights in panels
of 48 (AVX-512) or 16 (AVX2) outputs, streamed once per 8 or 6 rows of x; and the same GEMM over a GGUF's Q4_1 or
Q8_0 blocks (`pack_block_panels`, `block_panel_linear`; model/gguf_blocks.py), dequantized into L1 a k-block at a
time, whose results equal `panel_linear`'s on the dequantized weight bit for bit.

Built with OpenMP (-fopenmp): every at::parallel_for here is an `omp parallel` region on torch's intra-op threads,
each thread computing whole outputs (a GEMM panel, an attention work item, a row), so results do not depend on the
thread count. With -fopenmp-simd alone those loops compiled serially and a forward ran on one core (a decode step
of 32 requests at 200-token contexts: 210 ms, 141 ms on both cores of this machine).

`load()` returns the compiled attention op, `elementwise()` the library's namespace and `panels()` the same where
it has the GEMM, or None (with a warning, once) when no C++ toolchain can build it.
"""
from __future__ import annotations

import hashlib
import os
import threading
import warnings

import torch

_SOURCE = r"""
// Only the headers it needs (not torch/extension.h, which pulls in pybind11 and every op): the build is what a
// new user waits for at the first start.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

// exp(x) in plain arithmetic that `omp simd` vectorizes (std::exp stays a scalar libm call): Cephes' expf, 2^n
// exp(r) with r = x - n ln2 split in two parts and a degree-6 polynomial; within 2 ulp of expf over the clamped
// range, whose ends give finite results (so x / (1 + exp(-x)) is x or 0 there, never NaN).
static inline float exp_simd(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);  // (std::min/max take references: not vectorized)
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23 trick)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// The K and V rows of a request's keys sit at its slots, anywhere in the cache (a decode step's KV is ~70 MB at
// batch 16, read from memory): each key loop prefetches the row kSlotAhead slots ahead, which the hardware
// prefetcher cannot guess (a decode step's 30 layers at batch 16 and 104 keys: 21 ms without, 12 ms with it,
// alternated in one process on this 2-core machine; 4 ahead: 13 ms, 16: 12 ms).
constexpr int64_t kSlotAhead = 8;
static inline void prefetch_row(const float* r, int64_t D) {
  for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(r + d, 0, 3);
}

// Activations come in fp32, or in bf16 where a bf16 linear made them (model/linear.py); the kernels compute in fp32
// either way (a bf16 value widens exactly) and give an output that feeds a linear in its input's dtype, rounded to
// the nearest bf16, ties to even (as c10::BFloat16): the value the linear would round an fp32 output to.
using bf16_t = uint16_t;
static inline float widen(float v) { return v; }
static inline float widen(bf16_t v) {
  const uint32_t u = (uint32_t)v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline bf16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if (v != v) return 0x7fc0;  // NaN stays a (quiet) NaN
  return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);  // an inf stays inf: its low half is zero
}
static inline void narrow(float* p, float v) { *p = v; }
static inline void narrow(bf16_t* p, float v) { *p = bf16_bits(v); }
static inline float round_bf16(float v) { return widen(bf16_bits(v)); }  // to the nearest bf16, kept in fp32

// f(pointer to x's data) with the pointer typed by x's dtype: fp32 or bf16.
template <typename F>
static inline void by_dtype(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kBFloat16) f((const bf16_t*)x.data_ptr());
  else f(x.data_ptr<float>());
}
template <typename P>
using elem_t = std::remove_const_t<std::remove_pointer_t<P>>;

#if defined(__AVX512F__)
#include <immintrin.h>
// The scores of 16 keys at once, for head dims that are a multiple of 16 (AVX-512): a dot product per key reduced
// on its own spends more instructions on its horizontal sum than on its FMAs (a decode step over a cached few-shot
// prefix, read from cache, is bound by them). Here 16 accumulators (one per key: lane-wise partial sums over D)
// are reduced together by a transpose tree, 45 instructions for 16 sums; lane r of the result is key r's dot.
static inline __m512 hsum16(__m512 a[16]) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of a = a[2i], b = a[2i + 1]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's sums of a[4i .. 4i + 3]
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // the four 128-bit lanes summed: lane pairs, then the pairs' sums
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s[g * n + j] = scale * q_g . k_j for keys j in [j0, j0 + m), m <= 16, rows[r] = key j0 + r's row (a valid row
// repeated past m: its lanes are not stored).
static inline void scores16(const float* qg, int64_t G, int64_t D, const float* const* rows, int64_t m, float sc,
                            float* s, int64_t n, int64_t j0) {
  const __mmask16 keep = (__mmask16)((1u << m) - 1);
  for (int64_t g = 0; g < G; ++g) {
    const float* qr = qg + g * D;
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(qr + d);
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[r] + d), acc[r]);
    }
    _mm512_mask_storeu_ps(s + g * n + j0, keep, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(sc)));
  }
}

// out[h] = sum_j p[h * n + j] v_j for H query heads of a group (D = 16 DV), their H x DV accumulators held in
// registers for the whole key loop: each V row is loaded once for the H heads, where accumulating through memory
// loaded and stored every head's accumulators once per key. v_j is at vbase + slots[j] * stride.
template <int DV, int H>
static inline void weighted_values(const float* p, int64_t n, const float* vbase, const int32_t* slots,
                                   int64_t stride, float* out) {
  __m512 acc[H][DV];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < DV; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = vbase + (int64_t)slots[j] * stride;
    if (j + kSlotAhead < n) prefetch_row(vbase + (int64_t)slots[j + kSlotAhead] * stride, 16 * DV);
    __m512 v[DV];
    for (int c = 0; c < DV; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int h = 0; h < H; ++h) {
      const __m512 ph = _mm512_set1_ps(p[h * n + j]);
      for (int c = 0; c < DV; ++c) acc[h][c] = _mm512_fmadd_ps(ph, v[c], acc[h][c]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out + (h * DV + c) * 16, acc[h][c]);
}

// weighted_values for `heads` (1 .. H) heads: the count is a template argument, so the accumulators stay in
// registers.
template <int DV, int H>
static inline void weighted_values_for(int64_t heads, const float* p, int64_t n, const float* vbase,
                                       const int32_t* slots, int64_t stride, float* out) {
  if constexpr (H > 1) {
    if (heads < H) return weighted_values_for<DV, H - 1>(heads, p, n, vbase, slots, stride, out);
  }
  weighted_values<DV, H>(p, n, vbase, slots, stride, out);
}

// All G heads of a group, at most 16 accumulators (of the 32 zmm) at a time: 4 heads of 64 dims, 2 of 128.
template <int DV>
static inline void weighted_values_group(const float* s, int64_t n, int64_t G, const float* vbase,
                                         const int32_t* slots, int64_t stride, float* out) {
  constexpr int H = 16 / DV;
  for (int64_t g0 = 0; g0 < G; g0 += H)
    weighted_values_for<DV, H>(std::min<int64_t>(H, G - g0), s + g0 * n, n, vbase, slots, stride,
                               out + g0 * 16 * DV);
}
#endif

// q [T, Hq, D], k/v [S, Hkv, D] fp32 contiguous; table [R, L] int32; rows, prefix, extend, start: int64 [B].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
                           const at::Tensor& rows, const at::Tensor& prefix, const at::Tensor& extend,
                           const at::Tensor& start, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "paged_attention: fp32 q/k/v expected");
  TORCH_CHECK(table.scalar_type() == at::kInt && rows.scalar_type() == at::kLong && prefix.scalar_type() == at::kLong
              && extend.scalar_type() == at::kLong && start.scalar_type() == at::kLong,
              "paged_attention: int32 table and int64 per-request tensors expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && table.is_contiguous() &&
              rows.is_contiguous() && prefix.is_contiguous() && extend.is_contiguous() && start.is_contiguous(),
              "paged_attention: contiguous inputs expected");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t B = rows.size(0), L = table.size(1);
  auto out = at::empty_like(q);
  const int64_t *rw = rows.data_ptr<int64_t>(), *pr = prefix.data_ptr<int64_t>();
  const int64_t *ex = extend.data_ptr<int64_t>(), *st = start.data_ptr<int64_t>();
  // token -> request, so work items can be split evenly over tokens x kv heads
  std::vector<int64_t> req_of(T), pos_of(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < ex[b]; ++i) { req_of[st[b] + i] = b; pos_of[st[b] + i] = pr[b] + i; }
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const int32_t *tb = table.data_ptr<int32_t>();
  float *op = out.data_ptr<float>();
  const float sc = (float)scale;
  at::parallel_for(0, T * Hkv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> s, acc(G * D);
    for (int64_t w = lo; w < hi; ++w) {
      const int64_t t = w / Hkv, hk = w % Hkv, b = req_of[t], n = pos_of[t] + 1;
      const int32_t *slots = tb + rw[b] * L;
      const float *qg = qp + (t * Hq + hk * G) * D;
      s.resize(G * n);
      int64_t j = 0;
#if defined(__AVX512F__)
      if (D % 16 == 0)
        for (; j < n; j += 16) {
          const int64_t m = std::min<int64_t>(16, n - j);
          const float* rows16[16];
          for (int64_t r = 0; r < 16; ++r) {
            rows16[r] = kp + ((int64_t)slots[j + (r < m ? r : 0)] * Hkv + hk) * D;
            if (j + 16 + r < n) prefetch_row(kp + ((int64_t)slots[j + 16 + r] * Hkv + hk) * D, D);
          }
          scores16(qg, G, D, rows16, m, sc, s.data(), n, j);
        }
#endif
      for (; j < n; ++j) {
        const float *kr = kp + ((int64_t)slots[j] * Hkv + hk) * D;
        if (j + kSlotAhead < n) prefetch_row(kp + ((int64_t)slots[j + kSlotAhead] * Hkv + hk) * D, D);
        for (int64_t g = 0; g < G; ++g) {
          const float *qr = qg + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
          s[g * n + j] = dot * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float *sg = s.data() + g * n, m = -INFINITY, sum = 0.f;
        for (int64_t j = 0; j < n; ++j) m = sg[j] > m ? sg[j] : m;
        #pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) { sg[j] = exp_simd(sg[j] - m); sum += sg[j]; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
      }
      float* og = op + (t * Hq + hk * G) * D;
#if defined(__AVX512F__)
      if (D == 64 || D == 128) {
        if (D == 64) weighted_values_group<4>(s.data(), n, G, vp + hk * D, slots, Hkv * D, og);
        else weighted_values_group<8>(s.data(), n, G, vp + hk * D, slots, Hkv * D, og);
        continue;
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float *vr = vp + ((int64_t)slots[j] * Hkv + hk) * D;
        if (j + kSlotAhead < n) prefetch_row(vp + ((int64_t)slots[j + kSlotAhead] * Hkv + hk) * D, D);
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * n + j];
          float *a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      std::copy(acc.begin(), acc.end(), og);
    }
  });
  return out;
}

// ---- the decoder layer's elementwise ops, fused (fp32, contiguous rows; kernels/__init__.py dispatches) ----
// One pass over each row instead of the reference's 5-8 ATen ops per call, each an allocation and a dispatch:
// ~30 such ops a layer are most of a decode step's non-GEMM host time. Rows run in parallel only for long
// inputs (a prefill); a decode step's 16 rows run inline, since waking the second thread costs more than them.
constexpr int64_t kRowGrain = 64;

static void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), what,
              ": a contiguous fp32 [T, H] tensor expected");
}

// An activation: fp32 or bf16 (see widen).
static void check_activation(const at::Tensor& x, const char* what) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 2 &&
              x.is_contiguous(), what, ": a contiguous fp32 or bf16 [T, H] tensor expected");
}

// y = w * (x * rsqrt(mean(x^2) + eps)) for one row: transformers' LlamaRMSNorm in fp32, y in Y (see widen).
template <typename Y>
static inline void rms_row(const float* x, const float* w, Y* y, int64_t H, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < H; ++j) ss += x[j] * x[j];
  const float r = 1.f / std::sqrt(ss / (float)H + eps);
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) narrow(y + j, w[j] * (x[j] * r));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == H && w.is_contiguous(), "rms_norm: fp32 weight [H]");
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) rms_row(xp + t * H, wp, yp + t * H, H, (float)eps);
  });
  return y;
}

// (h, rms_norm(h)) for h = residual + x: residual and h fp32, x and the norm fp32 or bf16.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& residual, const at::Tensor& x, const at::Tensor& w,
                                                double eps) {
  check_rows(residual, "add_rms_norm");
  check_activation(x, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual and x differ in shape");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.numel() == H && w.is_contiguous(), "add_rms_norm: fp32 weight [H]");
  auto h = at::empty_like(residual), y = at::empty_like(x);
  const float *rp = residual.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  by_dtype(x, [&](auto xp) {
    auto* yp = (elem_t<decltype(xp)>*)y.data_ptr();
    at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        float* hr = hp + t * H;
#pragma omp simd
        for (int64_t j = 0; j < H; ++j) hr[j] = rp[t * H + j] + widen(xp[t * H + j]);
        rms_row(hr, wp, yp + t * H, H, (float)eps);
      }
    });
  });
  return {h, y};
}

// [T, 2I] (gate | up) -> [T, I] silu(gate) * up, in gate_up's dtype (fp32 or bf16).
at::Tensor silu_mul(const at::Tensor& gu) {
  check_activation(gu, "silu_mul");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "silu_mul: an even number of columns expected");
  auto y = at::empty({T, I}, gu.options());
  by_dtype(gu, [&](auto gp) {
    auto* yp = (elem_t<decltype(gp)>*)y.data_ptr();
    at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const auto *g = gp + t * 2 * I, *u = g + I;
        auto* o = yp + t * I;
#pragma omp simd
        for (int64_t j = 0; j < I; ++j) {
          const float gj = widen(g[j]);
          narrow(o + j, gj / (1.f + exp_simd(-gj)) * widen(u[j]));
        }
      }
    });
  });
  return y;
}

// Rotate-half RoPE of one head: o = x * cos + rotate_half(x) * sin.
template <typename X>
static inline void rope_head(const X* x, const float* c, const float* s, float* o, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) o[d] = widen(x[d]) * c[d] + (-widen(x[d + half])) * s[d];
#pragma omp simd
  for (int64_t d = half; d < D; ++d) o[d] = widen(x[d]) * c[d] + widen(x[d - half]) * s[d];
}

// qkv [T, (Hq + 2 Hkv) D] (fp32 or bf16) -> q [T, Hq, D] rotated, fp32; the rotated k and v written to the fp32
// k_cache/v_cache [S, Hkv, D] at slots [T]. cos/sin: [T, D], gathered at the tokens' positions.
at::Tensor rope_q_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t Hq,
                           int64_t Hkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slots) {
  check_activation(qkv, "rope_q_write_kv");
  check_rows(cos, "rope_q_write_kv (cos)");
  check_rows(sin, "rope_q_write_kv (sin)");
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (Hq + 2 * Hkv) * D && D % 2 == 0 && cos.size(0) == T && sin.sizes() == cos.sizes(),
              "rope_q_write_kv: qkv must be [T, (Hq + 2 Hkv) D] with cos/sin [T, D], D even");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous()
              && v_cache.is_contiguous() && k_cache.dim() == 3 && k_cache.size(1) == Hkv && k_cache.size(2) == D
              && v_cache.sizes() == k_cache.sizes(), "rope_q_write_kv: fp32 contiguous caches [S, Hkv, D] expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == T,
              "rope_q_write_kv: int64 slots [T] expected");
  auto q = at::empty({T, Hq, D}, qkv.options().dtype(at::kFloat));
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t S = k_cache.size(0), W = (Hq + 2 * Hkv) * D, KV = Hkv * D;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "rope_q_write_kv: slot out of range");
  by_dtype(qkv, [&](auto xp) {
    at::parallel_for(0, T, kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) {
        const auto* row = xp + t * W;
        const float *c = cp + t * D, *s = sp + t * D;
        for (int64_t h = 0; h < Hq; ++h) rope_head(row + h * D, c, s, qp + (t * Hq + h) * D, D);
        float *kd = kc + sl[t] * KV, *vd = vc + sl[t] * KV;
        for (int64_t h = 0; h < Hkv; ++h) rope_head(row + (Hq + h) * D, c, s, kd + h * D, D);
        for (int64_t j = 0; j < KV; ++j) vd[j] = widen(row[(Hq + Hkv) * D + j]);
      }
    });
  });
  return q;
}

// Row-wise argmax of [B, V] (the first maximal index, a NaN's if the row has one: torch.max's semantics), for the
// greedy sampler: two vectorized passes (the max, then the first 64-wide chunk holding it) where torch.max's
// index-tracking reduction is not vectorized (~0.8 ms over [16, 49152]).
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: an empty row");
  auto out = at::empty({B}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const float* r = xp + b * V;
    float m = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
    for (int64_t j = 0; j < V; ++j) {
      m = r[j] > m ? r[j] : m;
      nan |= r[j] != r[j];
    }
    int64_t idx = 0;
    if (nan) {
      while (r[idx] == r[idx]) ++idx;
    } else {
      for (int64_t c = 0; c < V; c += 64) {
        const int64_t e = std::min<int64_t>(V, c + 64);
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t j = c; j < e; ++j) hit |= r[j] == m;
        if (hit) {
          idx = c;
          while (r[idx] != m) ++idx;
          break;
        }
      }
    }
    op[b] = idx;
  }
  return out;
}

// ---- the linears: y = x W^T (+ b) over weights packed in panels of 3 vectors of outputs (AVX-512 or AVX2) ----
// A decode step streams every weight once for a few rows of x, so the GEMM must keep up with memory: oneDNN's
// kernels for 16 rows ran at ~2x the cycles a byte of this one (measured on an AVX-512 machine, benchmarks/
// cpu_speed.py). Panels [ceil(N / kPanel), K, kPanel] make each thread's share of the weight one sequential stream
// (a thread takes a contiguous range of panels). A kRows x kPanel block of accumulators takes each kPanel-float
// weight row once per kRows rows of x: 8 rows x 48 outputs (24 of the 32 zmm) on AVX-512, 6 rows x 16 outputs (12
// of the 16 ymm, beside the 2 weight vectors and the broadcast: at 4 x 24 GCC folded the weight loads into the
// FMAs and the loop ran load-bound) on AVX2. Loop nest, outer to inner:
// - chunks of x rows (kChunkBytes of x, which stays in L2 while the thread's panels stream past): a prefill's x
//   (MBs) would otherwise be re-read from L3 once per panel, the large-M slowdown this blocking removes;
// - the thread's panels, then blocks of kKBlock k-rows (12 KB of a panel: stays in L1 for all the chunk's row
//   groups, so the weight comes from memory once per chunk however many rows there are);
// - groups of kRows rows, whose accumulators go through y between k-blocks (an fp32 store and load are exact, so
//   each output is still one sum over k in order: results do not depend on the blocking).
// The first row group of a k-block prefetches the weight stream kPrefetch bytes ahead into L2 (running into the
// thread's next panel), so memory stays busy while the other row groups compute: at 16 rows the linears of a
// decode step took 55 ms instead of 68 (8 rows: 42 instead of 55), where an L1 prefetch a few KB ahead only
// reached 60 (benchmarks/cpu_speed.py --gemm, AVX-512).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define LMC_PANELS 1
#if defined(__AVX512F__)
using vec = __m512;
using lane_mask = __mmask16;
constexpr int64_t kLanes = 16, kVecs = 3, kRows = 8;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline vec vbroadcast(float x) { return _mm512_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline lane_mask first_lanes(int64_t n) { return (lane_mask)((1u << n) - 1); }
static inline vec vload_masked(const float* p, lane_mask m) { return _mm512_maskz_loadu_ps(m, p); }
static inline void vstore_masked(float* p, lane_mask m, vec v) { _mm512_mask_storeu_ps(p, m, v); }
#else
using vec = __m256;
using lane_mask = __m256i;
constexpr int64_t kLanes = 8, kVecs = 2, kRows = 6;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline vec vbroadcast(float x) { return _mm256_set1_ps(x); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline lane_mask first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vec vload_masked(const float* p, lane_mask m) { return _mm256_maskload_ps(p, m); }  // masked: no fault
static inline void vstore_masked(float* p, lane_mask m, vec v) { _mm256_maskstore_ps(p, m, v); }
#endif
// A weight vector from panels of fp32, or of bf16 (the high half of an fp32: widened exactly by a shift).
#if defined(__AVX512F__)
static inline vec wload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec wload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
static inline vec wload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec wload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif
constexpr int64_t kPanel = kVecs * kLanes;
constexpr int64_t kKBlock = 12 * 1024 / (kPanel * sizeof(float));
constexpr int64_t kChunkBytes = 256 * 1024;  // of interleaved x: 14 groups of 8 rows at K = 576
constexpr int64_t kPrefetch = 32 * 1024;

template <typename T>
static void pack_into(const T* src, T* dst, int64_t N, int64_t K, int64_t P) {
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t n = lo * kPanel; n < std::min(N, hi * kPanel); ++n)
      for (int64_t k = 0; k < K; ++k) dst[((n / kPanel) * K + k) * kPanel + n % kPanel] = src[n * K + k];
  });
}

// Panels in w's dtype: fp32, or bf16 (weight-only bf16: half the bytes a decode step streams).
at::Tensor pack_panels(const at::Tensor& w) {
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  TORCH_CHECK((w.scalar_type() == at::kFloat || bf16) && w.dim() == 2,
              "pack_panels: an fp32 or bf16 [N, K] weight expected");
  auto wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto out = at::zeros({P, K, kPanel}, w.options());  // outputs past N: zero weights, never stored
  if (bf16) pack_into((const uint16_t*)wc.data_ptr(), (uint16_t*)out.data_ptr(), N, K, P);
  else pack_into(wc.data_ptr<float>(), out.data_ptr<float>(), N, K, P);
  return out;
}

// One row group (MB <= kRows rows of x, interleaved: xg[k * kRows + i] is row i's x[k]) x k-rows [k0, k1) of one
// panel (`wk`: its k-row k0; outputs n0 .. n0 + kPanel - 1, `mask[j]` selecting the valid ones of the j-th vector, all of them when `full`:
// masked stores are slow on AMD's cores): accumulators start
// at 0 when `first`, else from y; y gets them back, plus the bias when `last`. The interleaving puts the kRows
// broadcasts of a k-row at fixed offsets of one pointer: with 8 row pointers the compiler spilled the loop's state
// to the stack and the kernel ran at half the FMA rate.
// A row group's accumulators: from 0 when `first`, else from y (an fp32 store and load are exact).
template <int MB>
static inline void acc_load(vec (&acc)[MB][kVecs], const float* y, int64_t N, const lane_mask* mask, bool full,
                            bool first) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kVecs; ++j)
      acc[i][j] = first ? vzero() : full ? vload(y + i * N + kLanes * j) : vload_masked(y + i * N + kLanes * j, mask[j]);
}

// ... back to y, plus the bias when `last`.
template <int MB>
static inline void acc_store(vec (&acc)[MB][kVecs], float* y, int64_t N, const lane_mask* mask, bool full,
                             const float* bias, bool last) {
  for (int j = 0; j < kVecs; ++j) {
    const vec b = last && bias ? vload_masked(bias + kLanes * j, mask[j]) : vzero();
    for (int i = 0; i < MB; ++i) {
      if (full) vstore(y + i * N + kLanes * j, vadd(acc[i][j], b));
      else vstore_masked(y + i * N + kLanes * j, mask[j], vadd(acc[i][j], b));
    }
  }
}

template <int MB, typename W>
static inline void panel_block(const float* xg, int64_t k0, int64_t k1, const W* wk, float* y, int64_t N,
                               const lane_mask* mask, bool full, const float* bias, bool first, bool last,
                               bool prefetch) {
  vec acc[MB][kVecs];
  acc_load<MB>(acc, y, N, mask, full, first);
  const float* xk = xg + k0 * kRows;
  for (int64_t k = k0; k < k1; ++k, wk += kPanel, xk += kRows) {
    if (prefetch) {  // harmless past the end of the weight: a prefetch never faults
      const char* ahead = (const char*)wk + kPrefetch;
      for (int64_t c = 0; c < kPanel * (int64_t)sizeof(W); c += 64) _mm_prefetch(ahead + c, _MM_HINT_T1);
    }
    vec w[kVecs];
    for (int j = 0; j < kVecs; ++j) w[j] = wload(wk + kLanes * j);
#pragma GCC unroll 8
    for (int i = 0; i < MB; ++i) {
      const vec xv = vbroadcast(xk[i]);
      for (int j = 0; j < kVecs; ++j) acc[i][j] = vfma(xv, w[j], acc[i][j]);
    }
  }
  acc_store<MB>(acc, y, N, mask, full, bias, last);
}

// panel_block for a group of `rows` (1 .. MB) rows: the row count is a template argument, so the accumulators stay
// in registers.
template <int MB, typename W>
static inline void panel_rows(int64_t rows, const float* xg, int64_t k0, int64_t k1, const W* wk, float* y,
                              int64_t N, const lane_mask* mask, bool full, const float* bias, bool first, bool last,
                              bool pf) {
  if constexpr (MB > 1) {
    if (rows < MB) return panel_rows<MB - 1>(rows, xg, k0, k1, wk, y, N, mask, full, bias, first, last, pf);
  }
  panel_block<MB>(xg, k0, k1, wk, y, N, mask, full, bias, first, last, pf);
}

// Block-quantized panels (`pack_block_panels`): a GGUF's Q4_1 or Q8_0 weights as they are stored, kept in that
// form. Per panel and block of 32 k-rows: the kPanel outputs' scales d and mins m (fp32), then their codes q: Q4_1
// two k-rows a byte (k-row 2i in the low nibble, 2i + 1 in the high, byte i * kPanel + n for output n), Q8_0 one
// signed byte each (m = 0). A weight is fma(d, q, m): d * q is exact in fp32 (an fp16 d times a 4- or 8-bit q), so
// it equals the GGUF's dequantized fp32 weight (gguf-py's d * q + m) to the bit, and the GEMM below adds the same
// products in the same order as panel_linear on that weight: the same y, bit for bit, from 0.625 (Q4_1) or 1.0625
// (Q8_0) bytes a weight instead of 4. Up to kFusedRows rows of x (decode batches) each weight is dequantized in
// registers as it is used (block_fused); more rows share one dequantization of a k-block into an L1 scratch, over
// which the fp32 panels' kernel runs.
constexpr int64_t kQBlock = 32;
static_assert(kKBlock % kQBlock == 0, "a k-block holds whole quantization blocks");
static inline int64_t qblock_bytes(int64_t bits) { return 2 * kPanel * 4 + kQBlock * kPanel * bits / 8; }
#if defined(__AVX512F__)
constexpr int kFusedRows = 4;  // 12 accumulators, 6 scales and mins, 6 weights: 25 of the 32 zmm
using ivec = __m512i;
static inline ivec codes_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline ivec codes_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline ivec low_nibbles(ivec v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
static inline ivec high_nibbles(ivec v) { return _mm512_srli_epi32(v, 4); }
static inline vec to_float(ivec v) { return _mm512_cvtepi32_ps(v); }
#else
constexpr int kFusedRows = 3;  // 6 accumulators, 4 scales and mins, 4 weights: 15 of the 16 ymm
using ivec = __m256i;
static inline ivec codes_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline ivec codes_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
static inline ivec low_nibbles(ivec v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
static inline ivec high_nibbles(ivec v) { return _mm256_srli_epi32(v, 4); }
static inline vec to_float(ivec v) { return _mm256_cvtepi32_ps(v); }
#endif

// One quantization block (kQBlock k-rows of a panel) into dst [kQBlock, kPanel] fp32.
template <int Bits>
static inline void dequantize_block(const uint8_t* blk, float* dst) {
  const float* d = (const float*)blk;
  const uint8_t* q = blk + 2 * kPanel * 4;
  for (int j = 0; j < kVecs; ++j) {
    const vec dj = vload(d + kLanes * j), mj = vload(d + kPanel + kLanes * j);
    if constexpr (Bits == 4) {
      for (int64_t i = 0; i < kQBlock / 2; ++i) {
        const ivec c = codes_u8(q + i * kPanel + kLanes * j);
        vstore(dst + 2 * i * kPanel + kLanes * j, vfma(dj, to_float(low_nibbles(c)), mj));
        vstore(dst + (2 * i + 1) * kPanel + kLanes * j, vfma(dj, to_float(high_nibbles(c)), mj));
      }
    } else {
      for (int64_t k = 0; k < kQBlock; ++k)
        vstore(dst + k * kPanel + kLanes * j, vfma(dj, to_float(codes_i8(q + k * kPanel + kLanes * j)), mj));
    }
  }
}

// codes uint8 [N, K] (Q4_1: 0..15; Q8_0: the int8 codes' bytes), scales and mins fp32 [N, K / 32] -> the panels,
// uint8 [P, K / 32, qblock_bytes(bits)] (outputs past N: zero scales, mins and codes, never stored).
at::Tensor pack_block_panels(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& mins, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "pack_block_panels: bits must be 4 (Q4_1) or 8 (Q8_0)");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) % kQBlock == 0,
              "pack_block_panels: uint8 codes [N, K] with K a multiple of 32 expected");
  const int64_t N = codes.size(0), K = codes.size(1), B = K / kQBlock, P = (N + kPanel - 1) / kPanel;
  for (const at::Tensor* t : {&scales, &mins})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == N && t->size(1) == B,
                "pack_block_panels: fp32 scales and mins [N, K / 32] expected");
  auto c = codes.contiguous(), sc = scales.contiguous(), mn = mins.contiguous();
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const float *dp = sc.data_ptr<float>(), *mp = mn.data_ptr<float>();
  const int64_t bytes = qblock_bytes(bits);
  auto out = at::zeros({P, B, bytes}, codes.options());
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t p = lo; p < hi; ++p)
      for (int64_t b = 0; b < B; ++b) {
        uint8_t* blk = op + (p * B + b) * bytes;
        float* d = (float*)blk;
        uint8_t* q = blk + 2 * kPanel * 4;
        for (int64_t n = p * kPanel; n < std::min(N, (p + 1) * kPanel); ++n) {
          const int64_t l = n - p * kPanel;
          d[l] = dp[n * B + b];
          d[kPanel + l] = mp[n * B + b];
          const uint8_t* src = cp + n * K + b * kQBlock;
          for (int64_t k = 0; k < kQBlock; ++k) {
            if (bits == 8) q[k * kPanel + l] = src[k];
            else q[(k / 2) * kPanel + l] |= (uint8_t)((src[k] & 15) << (4 * (k % 2)));
          }
        }
      }
  });
  return out;
}

// What panel_gemm hands a weight source: k-rows [k0, k1) of panel p, for x's row groups [g0, g1).
struct Tile {
  int64_t p, k0, k1, g0, g1, M, K, N;
  const float* xq;        // x, interleaved in groups of kRows rows (panel_block)
  float* y;               // y at the panel's first output
  const lane_mask* mask;  // the panel's valid outputs, all of them when `full`
  const float* bias;      // at the panel's first output, or null
  bool full, first, last;
  int64_t rows(int64_t g) const { return std::min<int64_t>(kRows, M - g * kRows); }
};

// The tile's row groups through panel_block, its weight rows at wk (the tile's k-row k0).
template <typename W>
static inline void tile_rows(const Tile& t, const W* wk, bool prefetch) {
  for (int64_t g = t.g0; g < t.g1; ++g)
    panel_rows<kRows>(t.rows(g), t.xq + g * t.K * kRows, t.k0, t.k1, wk, t.y + g * kRows * t.N, t.N, t.mask, t.full,
                      t.bias, t.first, t.last, prefetch && g == t.g0);
}

// panel_block over quantization blocks for one group of MB <= kFusedRows rows, each weight dequantized in registers
// as it is used: the same values, added in the same order, as dequantize_block then panel_block.
template <int MB, int Bits>
static inline void block_fused(const Tile& t, const uint8_t* blk) {
  vec acc[MB][kVecs];
  acc_load<MB>(acc, t.y, t.N, t.mask, t.full, t.first);
  const int64_t bytes = qblock_bytes(Bits);
  const float* xk = t.xq + t.k0 * kRows;
  for (int64_t k = t.k0; k < t.k1; k += kQBlock, blk += bytes) {
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch((const char*)blk + kPrefetch + c, _MM_HINT_T1);
    const float* d = (const float*)blk;
    const uint8_t* q = blk + 2 * kPanel * 4;
    vec dv[kVecs], mv[kVecs];
    for (int j = 0; j < kVecs; ++j) dv[j] = vload(d + kLanes * j), mv[j] = vload(d + kPanel + kLanes * j);
    for (int64_t r = 0; r < kQBlock; r += Bits == 4 ? 2 : 1) {
      vec w0[kVecs], w1[kVecs];
      for (int j = 0; j < kVecs; ++j) {
        if constexpr (Bits == 4) {
          const ivec c = codes_u8(q + (r / 2) * kPanel + kLanes * j);
          w0[j] = vfma(dv[j], to_float(low_nibbles(c)), mv[j]);
          w1[j] = vfma(dv[j], to_float(high_nibbles(c)), mv[j]);
        } else {
          w0[j] = vfma(dv[j], to_float(codes_i8(q + r * kPanel + kLanes * j)), mv[j]);
        }
      }
      for (int i = 0; i < MB; ++i) {
        const vec xv = vbroadcast(xk[i]);
        for (int j = 0; j < kVecs; ++j) acc[i][j] = vfma(xv, w0[j], acc[i][j]);
      }
      xk += kRows;
      if constexpr (Bits == 4) {
        for (int i = 0; i < MB; ++i) {
          const vec xv = vbroadcast(xk[i]);
          for (int j = 0; j < kVecs; ++j) acc[i][j] = vfma(xv, w1[j], acc[i][j]);
        }
        xk += kRows;
      }
    }
  }
  acc_store<MB>(acc, t.y, t.N, t.mask, t.full, t.bias, t.last);
}

template <int MB, int Bits>
static inline void block_fused_rows(int64_t rows, const Tile& t, const uint8_t* blk) {
  if constexpr (MB > 1) {
    if (rows < MB) return block_fused_rows<MB - 1, Bits>(rows, t, blk);
  }
  block_fused<MB, Bits>(t, blk);
}

// The tile from quantization blocks (blk: the tile's first).
template <int Bits>
static inline void block_tile(const Tile& t, const uint8_t* blk, float* scratch) {
  if (t.M <= kFusedRows) return block_fused_rows<kFusedRows, Bits>(t.M, t, blk);
  for (int64_t k = t.k0; k < t.k1; k += kQBlock, blk += qblock_bytes(Bits)) {
    for (int64_t c = 0; c < qblock_bytes(Bits); c += 64) _mm_prefetch((const char*)blk + kPrefetch + c, _MM_HINT_T1);
    dequantize_block<Bits>(blk, scratch + (k - t.k0) * kPanel);
  }
  tile_rows(t, (const float*)scratch, false);
}

// y [M, N] fp32 = x [M, K] (fp32 or bf16, contiguous; rounded to bf16 when `round_x`) times a weight in P panels,
// plus `bias` (or none); `tile(t, scratch)` computes one Tile from the weight's source (`scratch`: kKBlock x kPanel
// floats of the calling thread).
template <typename TileFn>
static void panel_gemm(const at::Tensor& x, int64_t N, int64_t P, bool round_x, const float* bias, float* yp,
                       TileFn tile) {
  const int64_t M = x.size(0), K = x.size(1), G = (M + kRows - 1) / kRows;
  auto xi = at::empty({G, K, kRows}, x.options().dtype(at::kFloat));  // x in groups of kRows rows (panel_block)
  float* xq = xi.data_ptr<float>();
  by_dtype(x, [&](auto xp) {
    at::parallel_for(0, G, kRowGrain / kRows, [&](int64_t lo, int64_t hi) {
      for (int64_t g = lo; g < hi; ++g) {
        const int64_t rows = std::min<int64_t>(kRows, M - g * kRows);
        float* dst = xq + g * K * kRows;
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t k = 0; k < K; ++k) {
            const float v = widen(xp[(g * kRows + i) * K + k]);
            dst[k * kRows + i] = round_x ? round_bf16(v) : v;
          }
      }
    });
  });
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (K * kRows * (int64_t)sizeof(float)));  // in groups
  at::parallel_for(0, P, 1, [&](int64_t lo, int64_t hi) {
    alignas(64) float scratch[kKBlock * kPanel];
    for (int64_t c0 = 0; c0 < G; c0 += chunk) {
      const int64_t c1 = std::min(G, c0 + chunk);
      for (int64_t p = lo; p < hi; ++p) {
        const int64_t n0 = p * kPanel, rem = std::min(kPanel, N - n0);
        lane_mask mask[kVecs];
        for (int j = 0; j < kVecs; ++j) mask[j] = first_lanes(std::max<int64_t>(0, std::min(kLanes, rem - kLanes * j)));
        for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
          const int64_t k1 = std::min(K, k0 + kKBlock);
          tile(Tile{p, k0, k1, c0, c1, M, K, N, xq, yp + n0, mask, bias ? bias + n0 : nullptr, rem == kPanel,
                    k0 == 0, k1 == K}, scratch);
        }
      }
    }
  });
}

static void check_linear_args(const at::Tensor& x, const std::optional<at::Tensor>& bias, int64_t N, const char* what) {
  check_activation(x, what);
  TORCH_CHECK(!(bias.has_value() && bias->defined()) ||
              (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              what, ": an fp32 bias [N] expected");
}

// x [M, K] fp32 or bf16 contiguous, panels from pack_panels of an [N, K] weight, bias [N] or none -> [M, N] fp32.
// bf16 panels take x rounded to bf16 (the products exact in fp32, summed in fp32) and round y to bf16 before the
// bias is added in fp32: as oneDNN's bf16 GEMM, whose output is bf16 (model/linear.py hands it the larger row counts).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const std::optional<at::Tensor>& bias) {
  check_linear_args(x, bias, N, "panel_linear");
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  const int64_t K = x.size(1), P = panels.size(0);
  TORCH_CHECK((panels.scalar_type() == at::kFloat || bf16) && panels.is_contiguous() && panels.dim() == 3 &&
              panels.size(1) == K && panels.size(2) == kPanel && P * kPanel >= N && (P - 1) * kPanel < N,
              "panel_linear: the panels are not an [N, K] weight's for this x");
  const float* bias_p = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  auto y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const void* wp = panels.data_ptr();
  if (bf16) {  // the bias is added after the rounding, below
    panel_gemm(x, N, P, true, nullptr, yp, [&](const Tile& t, float*) {
      tile_rows(t, (const uint16_t*)wp + (t.p * K + t.k0) * kPanel, true);
    });
    at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i)
        for (int64_t n = 0; n < N; ++n) yp[i * N + n] = round_bf16(yp[i * N + n]) + (bias_p ? bias_p[n] : 0.f);
    });
  } else {
    panel_gemm(x, N, P, false, bias_p, yp, [&](const Tile& t, float*) {
      tile_rows(t, (const float*)wp + (t.p * K + t.k0) * kPanel, true);
    });
  }
  return y;
}

// panel_linear over block-quantized panels (pack_block_panels; `bits` 4 or 8): y equals panel_linear's on the
// dequantized weight, bit for bit.
at::Tensor block_panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N, int64_t bits,
                              const std::optional<at::Tensor>& bias) {
  check_linear_args(x, bias, N, "block_panel_linear");
  const int64_t K = x.size(1), P = panels.size(0), B = K / kQBlock, bytes = qblock_bytes(bits);
  TORCH_CHECK((bits == 4 || bits == 8) && panels.scalar_type() == at::kByte && panels.is_contiguous() &&
              panels.dim() == 3 && K % kQBlock == 0 && panels.size(1) == B && panels.size(2) == bytes &&
              P * kPanel >= N && (P - 1) * kPanel < N,
              "block_panel_linear: the panels are not an [N, K] weight's for this x");
  const float* bias_p = bias.has_value() && bias->defined() ? bias->data_ptr<float>() : nullptr;
  auto y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
  const uint8_t* wp = panels.data_ptr<uint8_t>();
  panel_gemm(x, N, P, false, bias_p, y.data_ptr<float>(), [&](const Tile& t, float* scratch) {
    const uint8_t* blk = wp + (t.p * B + t.k0 / kQBlock) * bytes;
    if (bits == 4) block_tile<4>(t, blk, scratch);
    else block_tile<8>(t, blk, scratch);
  });
  return y;
}
#endif

TORCH_LIBRARY(lmc_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor rows, Tensor prefix, Tensor extend, "
        "Tensor start, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor residual, Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rope_q_write_kv(Tensor qkv, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> Tensor");
#ifdef LMC_PANELS
  m.def("pack_panels(Tensor w) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("pack_block_panels(Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
  m.def("block_panel_linear(Tensor x, Tensor panels, int n, int bits, Tensor? bias) -> Tensor");
#endif
}
TORCH_LIBRARY_IMPL(lmc_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rope_q_write_kv", &rope_q_write_kv);
#ifdef LMC_PANELS
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
  m.impl("pack_block_panels", &pack_block_panels);
  m.impl("block_panel_linear", &block_panel_linear);
#endif
}
"""

_lock = threading.Lock()
_loaded: list = []  # [op or None] once load() has run


def build_dir() -> str:
    """torch's own TORCH_EXTENSIONS_DIR when set, else the lmc cache dir."""
    from ..model.loader import cache_dir

    path = os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_dir() / "torch_extensions")
    os.makedirs(path, exist_ok=True)
    return path


def library_dir() -> str:
    """Where the library is built: one directory per torch installation under build_dir(). The build's ninja file
    names the headers of the torch that built it, so two virtualenvs sharing one directory (a checkout's and a CI
    clone's) rebuilt the library at each other's next start (48 s on 2 cores)."""
    torch_install = hashlib.sha1(os.path.dirname(torch.__file__).encode()).hexdigest()[:10]
    return os.path.join(build_dir(), f"lmc_cpu_kernels_{torch_install}")


def load():
    """The compiled `paged_attention`, or None when it cannot be built here (the caller falls back)."""
    with _lock:
        if not _loaded:
            _loaded.append(_build())
        return _loaded[0]


def elementwise():
    """`torch.ops.lmc_cpu` (rms_norm, add_rms_norm, silu_mul, rope_q_write_kv), or None where the library cannot
    be built."""
    return torch.ops.lmc_cpu if load() is not None else None


def panels():
    """`torch.ops.lmc_cpu` when it has the panel GEMM (`pack_panels`, `panel_linear`: built on AVX-512
    and AVX2 CPUs only), else None."""
    lib = elementwise()
    return lib if lib is not None and _has_panels() else None


def _has_panels() -> bool:
    # hasattr, not a dispatch-key probe: that raises for an op the library never defined (a CPU without AVX-512)
    return hasattr(torch.ops.lmc_cpu, "panel_linear")


def _build():
    try:
        from torch.utils.cpp_extension import load_inline

        # torch's builder hashes the source: an edited kernel is rebuilt, an unchanged one is loaded as built.
        path = library_dir()
        os.makedirs(path, exist_ok=True)
        load_inline("lmc_cpu_kernels", cpp_sources=_SOURCE, build_directory=path, verbose=False,
                    is_python_module=False, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"])
        op = torch.ops.lmc_cpu.paged_attention
        # Its output is shaped like q: what torch.compile needs to trace through the op without running it.
        torch.library.register_fake("lmc_cpu::paged_attention")(lambda q, *_: torch.empty_like(q))
        if _has_panels():
            torch.library.register_fake("lmc_cpu::panel_linear")(lambda x, panels, n, bias: x.new_empty(x.shape[0], n))
            torch.library.register_fake("lmc_cpu::block_panel_linear")(
                lambda x, panels, n, bits, bias: x.new_empty(x.shape[0], n))
        return op
    except Exception as e:  # no compiler, no ninja, a failed build: the torch reference ops run instead
        warnings.warn(f"the CPU kernels could not be built ({type(e).__name__}: {e}); "
                      "falling back to gather + SDPA attention and torch elementwise ops", RuntimeWarning, stacklevel=3)
        return None
