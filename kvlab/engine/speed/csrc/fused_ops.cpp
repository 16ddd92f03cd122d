// kvlab's one-pass CPU ops for a Llama layer (RMSNorm with the residual sum, RoPE, SwiGLU) and the panel
// GEMM for calls of few rows. The Python side and what each op computes: ../fused_ops.py,
// ../packed_linear.py. Built by ../cpp_build.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <utility>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "exp_clamped.h"

namespace {

// rows of about this many floats per thread task: a decode step's few rows stay on one thread
constexpr int64_t kGrainFloats = 1 << 15;

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, what, " must be a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be 2-D with contiguous rows");
}

using kvlab::exp_clamped;

// y = w * (x * (1 / sqrt(mean(x^2) + eps))), one row of n
inline void norm_row(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ w,
                     int64_t n, float eps) {
  float part[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += x[i + l] * x[i + l];
  float sum = 0.0f;
  for (int l = 0; l < 16; ++l) sum += part[l];
  for (; i < n; ++i) sum += x[i] * x[i];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) y[j] = w[j] * (x[j] * r);
}

torch::Tensor norm_rows(torch::Tensor x, const torch::Tensor* d, torch::Tensor w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.is_contiguous(),
              "the weight must be a contiguous 1-D float32 CPU tensor");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.numel() == n, "the weight has ", w.numel(), " values for rows of ", n);
  if (d != nullptr) {
    check_rows(*d, "the residual's delta");
    TORCH_CHECK(d->sizes() == x.sizes(), "the delta's shape differs from x's");
  }
  auto y = torch::empty({rows, n}, x.options());
  float* xp = x.data_ptr<float>();
  const float* dp = d == nullptr ? nullptr : d->data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), ds = d == nullptr ? 0 : d->stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = xp + r * xs;
      if (dp != nullptr) {
        const float* dr = dp + r * ds;
        for (int64_t j = 0; j < n; ++j) row[j] += dr[j];
      }
      norm_row(yp + r * n, row, wp, n, e);
    }
  });
  return y;
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) { return norm_rows(x, nullptr, w, eps); }

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor d, torch::Tensor w, double eps) {
  return norm_rows(x, &d, w, eps);
}

void rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t dim) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = qkv.size(0), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && heads * dim <= qkv.size(1), "rope: ", heads, " heads of ", dim,
              " do not fit rows of ", qkv.size(1));
  TORCH_CHECK(cos.size(0) == rows && sin.size(0) == rows && cos.size(1) == dim && sin.size(1) == dim,
              "rope: cos and sin must be (", rows, ", ", dim, ")");
  float* p = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ps = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / (heads * dim)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cp + r * cs;
      const float* s = sp + r * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = p + r * ps + h * dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): two products, then their sum
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gu) {
  check_rows(gu, "gate_up");
  const int64_t rows = gu.size(0), n = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) % 2 == 0, "gate_up must have an even width (gate, then up)");
  auto y = torch::empty({rows, n}, gu.options());
  const float* g = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t gs = gu.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrainFloats / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gr = g + r * gs;
      const float* ur = gr + n;
      float* yr = yp + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const float x = gr[j];
        yr[j] = (x / (1.0f + exp_clamped(-x))) * ur[j];
      }
    }
  });
  return y;
}

bool panel_gemm_available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

// w (N, K) -> panels (ceil(N / 16), K, 16): panel b holds columns 16b.. of the output, k by k (zero past N)
// in 2 MiB pages where the kernel gives them (Linux's transparent huge pages on request, MADV_HUGEPAGE) when
// they fill one: a decode step streams every panel, and with 4 KiB pages its TLB misses cost (one 16-decode step
// of SmolLM2 at 2 threads, 8 steps at a time alternated with a second engine's as scripts/bench.py does: 42.2 ms
// with 4 KiB pages, 34.0 to 38.9 in three runs with huge pages)
torch::Tensor pack_panels(torch::Tensor w) {
  check_rows(w, "w");
  const int64_t n = w.size(0), k = w.size(1), nb = (n + 15) / 16;
  const auto bytes = static_cast<size_t>(nb * k * 16) * sizeof(float);
  constexpr size_t kHuge = size_t{1} << 21;
  torch::Tensor panels;
#ifdef __linux__
  if (bytes >= kHuge) {
    const size_t size = (bytes + kHuge - 1) / kHuge * kHuge;
    void* mem = std::aligned_alloc(kHuge, size);
    TORCH_CHECK(mem != nullptr, "pack_panels: out of memory (", size, " bytes)");
    madvise(mem, size, MADV_HUGEPAGE);  // a hint: where it fails, the pages stay 4 KiB
    panels = torch::from_blob(mem, {nb, k, 16}, [](void* m) { std::free(m); }, w.options());
  }
#endif
  if (!panels.defined()) panels = torch::empty({nb, k, 16}, w.options());
  // panel b, row kk: w[16b .. 16b + 16, kk], zero past n
  auto padded = torch::zeros({nb * 16, k}, w.options());
  padded.narrow(0, 0, n).copy_(w);
  panels.copy_(padded.view({nb, 16, k}).transpose(1, 2));
  return panels;
}

#ifdef __AVX512F__
namespace {
// how far ahead in the panels (64-byte lines: one per k) the stream is prefetched into L2; a decode
// step's 16-row GEMMs over SmolLM2's weights, 1 thread: 56.5 ms unprefetched, 49.5 at 32 lines, 47.1 at 512
constexpr int64_t kPrefetchLines = 512;

// out[i, col..col+16) = sum over k of xt[k][i] * w[k][...] (+ bias), for R rows: R accumulators in registers,
// one load of the panel's row k for all R rows
template <int R>
void panel_rows(const float* __restrict__ xt, const float* __restrict__ w, int64_t k, float* __restrict__ out,
                int64_t ldo, __mmask16 mask, const float* bias, bool prefetch) {
  __m512 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (kk + kPrefetchLines) * 16), _MM_HINT_T1);
    const __m512 wv = _mm512_loadu_ps(w + kk * 16);
    const float* xr = xt + kk * 16;
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xr[i]), wv, acc[i]);
  }
  const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(out + i * ldo, mask, _mm512_add_ps(acc[i], b));
}

using PanelRows = void (*)(const float*, const float*, int64_t, float*, int64_t, __mmask16, const float*, bool);
template <std::size_t... I>
constexpr std::array<PanelRows, 16> panel_table(std::index_sequence<I...>) { return {&panel_rows<I + 1>...}; }
// PANEL_ROWS[r - 1]: r rows
constexpr auto PANEL_ROWS = panel_table(std::make_index_sequence<16>{});
}  // namespace
#endif

// x (M, K) @ w.T + bias -> (M, n), w given as pack_panels(w); bias empty or (n,)
torch::Tensor panel_gemm(torch::Tensor x, torch::Tensor panels, torch::Tensor bias, int64_t n) {
#ifdef __AVX512F__
  check_rows(x, "x");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const int64_t m = x.size(0), k = x.size(1), nb = panels.size(0);
  TORCH_CHECK(panels.scalar_type() == torch::kFloat32 && panels.dim() == 3 && panels.is_contiguous() &&
                  panels.size(1) == k && panels.size(2) == 16 && n > 0 && nb == (n + 15) / 16,
              "panels must be pack_panels of an (n, K) weight, K = x.size(1)");
  TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 1 && bias.size(0) == n && bias.is_contiguous() &&
                                    bias.scalar_type() == torch::kFloat32),
              "bias must be empty or a contiguous float32 (n,)");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  // x by chunks of 16 rows, each laid out k by k: (chunks, K, 16), a row's k-th value at [c][k][i]
  const int64_t chunks = (m + 15) / 16;
  auto xt = torch::empty({chunks, k, 16}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xtp = xt.data_ptr<float>();
  TORCH_CHECK(16 * k <= INT32_MAX, "x's rows are too long for panel_gemm");
  // one gather per k: the chunk's rows' k-th values (lanes past the last row: 0)
  const __m512i row_starts = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(k)));
  for (int64_t c = 0; c < chunks; ++c) {
    const auto rows = static_cast<__mmask16>((1u << std::min<int64_t>(16, m - c * 16)) - 1u);
    const float* base = xp + c * 16 * k;
    for (int64_t kk = 0; kk < k; ++kk)
      _mm512_storeu_ps(xtp + (c * k + kk) * 16,
                       _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, row_starts, base + kk, 4));
  }
  const float* wp = panels.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // each thread streams one run of panels; a panel is read from memory once, by the first chunk (the
  // others find it in L2)
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t col = b * 16;
      const auto mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - col)) - 1u);
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t rows = std::min<int64_t>(16, m - c * 16);
        PANEL_ROWS[rows - 1](xtp + c * k * 16, wp + b * k * 16, k, op + c * 16 * n + col, n, mask,
                             bp != nullptr ? bp + col : nullptr, c == 0);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "panel_gemm needs a build with AVX-512 (panel_gemm_available() is false)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", torch::wrap_pybind_function(rms_norm), "RMSNorm of each row");
  m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "x += d, then RMSNorm of x");
  m.def("rope", torch::wrap_pybind_function(rope), "RoPE in place on the first heads of each row");
  m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "SwiGLU of [gate; up]");
  m.def("panel_gemm_available", torch::wrap_pybind_function(panel_gemm_available), "whether the build has the AVX-512 panel GEMM");
  m.def("pack_panels", torch::wrap_pybind_function(pack_panels), "a weight laid out in panels of 16 columns");
  m.def("panel_gemm", torch::wrap_pybind_function(panel_gemm), "F.linear on packed panels, for few rows");
}
