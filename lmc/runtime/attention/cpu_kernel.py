"""A C++ CPU attention kernel that reads K and V through the slot table, built once with torch's extension
builder and cached on disk under the lmc cache dir (`$LMC_CACHE_DIR/torch_extensions`): later starts load the
built library in a few seconds (`TORCH_EXTENSIONS_DIR` overrides the place).

`paged_attention(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, extend_start, scale)` computes, for
every new token t of request b (flat index extend_start[b] + i, absolute position prefix_lens[b] + i), causal
attention over keys 0..position read at slots table[rows[b], j]. Work items are (token, kv head): the K and V rows
of a slot are loaded once for all query heads of the group (GQA). Scores go to a per-item buffer, then a two-pass
softmax in fp32 (as transformers' eager attention, so logprobs match it). No K/V is copied.

`load()` returns the compiled op, or None (with a warning) when no C++ toolchain can build it.
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

_SOURCE = r"""
// Only the headers it needs (not torch/extension.h, which pulls in pybind11 and every op): the build is what a
// new user waits for at the first start.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <cmath>
#include <vector>

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
      for (int64_t j = 0; j < n; ++j) {
        const float *kr = kp + ((int64_t)slots[j] * Hkv + hk) * D;
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
        for (int64_t j = 0; j < n; ++j) { sg[j] = std::exp(sg[j] - m); sum += sg[j]; }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const float *vr = vp + ((int64_t)slots[j] * Hkv + hk) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * n + j];
          float *a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      std::copy(acc.begin(), acc.end(), op + (t * Hq + hk * G) * D);
    }
  });
  return out;
}

TORCH_LIBRARY(lmc_cpu, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor table, Tensor rows, Tensor prefix, Tensor extend, "
        "Tensor start, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(lmc_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
"""

_lock = threading.Lock()
_loaded: list = []  # [op or None] once load() has run


def build_dir() -> str:
    """torch's own TORCH_EXTENSIONS_DIR when set, else the lmc cache dir."""
    from ..model.loader import cache_dir

    path = os.environ.get("TORCH_EXTENSIONS_DIR") or str(cache_dir() / "torch_extensions")
    os.makedirs(path, exist_ok=True)
    return path


def load():
    """The compiled `paged_attention`, or None when it cannot be built here (the caller falls back)."""
    with _lock:
        if not _loaded:
            _loaded.append(_build())
        return _loaded[0]


def _build():
    try:
        from torch.utils.cpp_extension import load_inline

        # torch's builder hashes the source: an edited kernel is rebuilt, an unchanged one is loaded as built.
        path = os.path.join(build_dir(), "lmc_cpu_attention")
        os.makedirs(path, exist_ok=True)
        load_inline("lmc_cpu_attention", cpp_sources=_SOURCE, build_directory=path, verbose=False,
                    is_python_module=False, extra_cflags=["-O3", "-march=native", "-fopenmp-simd"])
        op = torch.ops.lmc_cpu.paged_attention
        # Its output is shaped like q: what torch.compile needs to trace through the op without running it.
        torch.library.register_fake("lmc_cpu::paged_attention")(lambda q, *_: torch.empty_like(q))
        return op
    except Exception as e:  # no compiler, no ninja, a failed build: attention falls back to gather + SDPA
        warnings.warn(f"the CPU attention kernel could not be built ({type(e).__name__}: {e}); "
                      "falling back to gather + SDPA", RuntimeWarning, stacklevel=3)
        return None

