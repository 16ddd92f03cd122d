// kvlab's paged-attention kernel for a CPU: attends each sequence's queries over its K/V pages in place,
// through its block table (attend), and writes a step's new K/V into the pages (write_kv). The Python
// side, what it computes and when it is used: ../paged_kernel.py. Built by ../cpp_build.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "exp_clamped.h"

namespace {

using kvlab::exp_clamped;

// x[i] = e^(x[i] - sub) for i < n; returns their sum (added in order). Two loops: the first, with no
// sum carried from one element to the next, vectorises
inline float exp_sub_sum(float* x, int64_t n, float sub) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp_clamped(x[i] - sub);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i];
  return sum;
}

// scores s[t] = q . k[t] of nt keys (rows of n floats): four keys at a time, each an OpenMP simd
// reduction (vector lanes over d, added up once per key)
inline void dots(float* __restrict__ s, const float* __restrict__ q, const float* __restrict__ k,
                 int64_t nt, int64_t n) {
  int64_t t = 0;
  for (; t + 4 <= nt; t += 4) {
    const float* k0 = k + t * n;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t d = 0; d < n; ++d) {
      s0 += q[d] * k0[d];
      s1 += q[d] * k0[n + d];
      s2 += q[d] * k0[2 * n + d];
      s3 += q[d] * k0[3 * n + d];
    }
    s[t] = s0;
    s[t + 1] = s1;
    s[t + 2] = s2;
    s[t + 3] = s3;
  }
  for (; t < nt; ++t) {
    float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
    for (int64_t d = 0; d < n; ++d) s0 += q[d] * k[t * n + d];
    s[t] = s0;
  }
}

// y[d] = y[d] * c + sum over t of p[t] * v[t][d]. Where n is a multiple of 16, 16 of y's values at a
// time stay in a vector register across every t (the same operations in the same order, so the same
// results as the plain loop below, which loads and stores y once per t)
inline void scale_add(float* __restrict__ y, float c, const float* __restrict__ p,
                      const float* __restrict__ v, int64_t nt, int64_t n) {
  if (n % 16 == 0) {
    for (int64_t d0 = 0; d0 < n; d0 += 16) {
      float a[16];
      for (int l = 0; l < 16; ++l) a[l] = y[d0 + l] * c;
      for (int64_t t = 0; t < nt; ++t) {
        const float w = p[t];
        const float* vt = v + t * n + d0;
        for (int l = 0; l < 16; ++l) a[l] += w * vt[l];
      }
      for (int l = 0; l < 16; ++l) y[d0 + l] = a[l];
    }
    return;
  }
  for (int64_t d = 0; d < n; ++d) y[d] *= c;
  for (int64_t t = 0; t < nt; ++t) {
    const float w = p[t];
    const float* vt = v + t * n;
    for (int64_t d = 0; d < n; ++d) y[d] += w * vt[d];
  }
}

// ask for a block's K and V (n floats each, from offset) ahead of their use: blocks lie anywhere in
// the store, so the hardware prefetcher cannot guess the next one
inline void prefetch_block(const float* k, const float* v, int64_t offset, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    __builtin_prefetch(k + offset + i);
    __builtin_prefetch(v + offset + i);
  }
}

#if defined(__AVX512F__)
// The decode path: one query token per sequence, its KV head's query rows (up to R at a time) held in
// vector registers. Per 64 keys: each row's scores, 16 to a vector (each key's partial products for
// every row from one load of its K, then a 16 x 16 transpose-and-add per row); the online softmax on
// those vectors; then every key's values added into every row's sums (in registers), each value vector
// loaded once for the R rows. Written for AVX-512 and a head dimension of 16 * DC floats.

// s[t] = the sum of p[t]'s 16 lanes, for t < 16
inline __m512 sum16(__m512* p) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                         _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  // a[i]'s 128-bit lane l: (p[2i] 0+2, p[2i+1] 0+2, p[2i] 1+3, p[2i+1] 1+3) of that lane
  for (int i = 0; i < 4; ++i) {
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // b[i]'s 128-bit lane l: the lane-l sums of keys 4i .. 4i+3, in order
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  // c[i]: keys 8i .. 8i+3 (lanes 0+2, then 1+3), keys 8i+4 .. 8i+7 (the same)
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

// exp_clamped on 16 lanes (the same polynomial)
inline __m512 exp16(__m512 x) {
  // the bound first: max_ps and min_ps give their second operand where either is NaN, so a NaN stays NaN
  x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  // a NaN's n becomes 0 (y carries the NaN)
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(n, n, _CMP_ORD_Q), n)),
                       _mm512_set1_epi32(127)),
      23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// rows q[0 .. R) (prescaled, 16 * DC floats each) against the keys [lo, hi) of one sequence's blocks
// (table; block b's keys at kp + (base + b) * bs * dim); writes each row's output to dst[r]. The
// online softmax moves 64 keys at a time (4 vectors of scores a row): one rescale of the sums per 64.
template <int R, int DC>
void decode_rows(const float* q, float* const* dst, const float* kp, const float* vp, const int64_t* table,
                 int64_t base, int64_t bs, int64_t lo, int64_t hi) {
  constexpr int64_t dim = 16 * DC;
  constexpr int W = 4;
  const float inf = std::numeric_limits<float>::infinity();
  __m512 qr[R][DC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) qr[r][c] = _mm512_loadu_ps(q + r * dim + 16 * c);
  alignas(64) float accm[R][dim];
  alignas(64) float pb[R][16 * W];
  float mx[R], sum[R];
  for (int r = 0; r < R; ++r) {
    std::fill(accm[r], accm[r] + dim, 0.0f);
    mx[r] = -inf;
    sum[r] = 0.0f;
  }
  // each key's offset in the pages (K's and V's alike). No software prefetch: in the engine's steps (16
  // decodes of SmolLM2 after 512 tokens, shared or not, 1 or 2 threads) asking for the next 64 keys ahead,
  // every cache line or one in four, was slower than none (isolated, 1 thread: 96 and 97 ms against 87)
  int64_t at[16 * W];
  for (int64_t k0 = lo; k0 < hi; k0 += 16 * W) {
    const int n = static_cast<int>(std::min<int64_t>(16 * W, hi - k0));
    {
      int64_t blk = k0 / bs, in = k0 % bs, row = (base + table[blk]) * bs;
      for (int t = 0; t < n; ++t) {
        at[t] = (row + in) * dim;
        if (++in == bs && t + 1 < n) {
          in = 0;
          row = (base + table[++blk]) * bs;
        }
      }
    }
    // per row, 16 scores a vector (-inf past the n keys)
    __m512 s[R][W];
    __mmask16 valid[W];
    for (int w = 0; w < W; ++w) {
      const int nw = std::max(0, std::min(16, n - 16 * w));
      valid[w] = static_cast<__mmask16>((1u << nw) - 1u);
      // each key's partial products for every row (its K loaded once), then per row its 16 scores
      __m512 part[R][16];
      for (int t = 0; t < 16; ++t) {
        if (t < nw) {
          const float* kt = kp + at[16 * w + t];
          __m512 kv[DC];
          for (int c = 0; c < DC; ++c) kv[c] = _mm512_loadu_ps(kt + 16 * c);
          for (int r = 0; r < R; ++r) {
            __m512 x = _mm512_mul_ps(qr[r][0], kv[0]);
            for (int c = 1; c < DC; ++c) x = _mm512_fmadd_ps(qr[r][c], kv[c], x);
            part[r][t] = x;
          }
        } else {
          for (int r = 0; r < R; ++r) part[r][t] = _mm512_setzero_ps();
        }
      }
      for (int r = 0; r < R; ++r) s[r][w] = _mm512_mask_blend_ps(valid[w], _mm512_set1_ps(-inf), sum16(part[r]));
    }
    float cr[R];
    for (int r = 0; r < R; ++r) {
      __m512 m = s[r][0];
      for (int w = 1; w < W; ++w) m = _mm512_max_ps(m, s[r][w]);
      const float top = std::max(mx[r], _mm512_reduce_max_ps(m));
      // e^(old max - new max): 0 for the first keys (old max -inf)
      cr[r] = mx[r] == -inf ? 0.0f : exp_clamped(mx[r] - top);
      __m512 tot = _mm512_setzero_ps();
      for (int w = 0; w < W; ++w) {
        const __m512 p = _mm512_maskz_mov_ps(valid[w], exp16(_mm512_sub_ps(s[r][w], _mm512_set1_ps(top))));
        _mm512_store_ps(pb[r] + 16 * w, p);
        tot = _mm512_add_ps(tot, p);
      }
      sum[r] = sum[r] * cr[r] + _mm512_reduce_add_ps(tot);
      mx[r] = top;
    }
    // each key's values loaded once for every row
    __m512 y[R][DC];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < DC; ++c) y[r][c] = _mm512_mul_ps(_mm512_load_ps(accm[r] + 16 * c), _mm512_set1_ps(cr[r]));
    for (int t = 0; t < n; ++t) {
      const float* vt = vp + at[t];
      __m512 v[DC];
      for (int c = 0; c < DC; ++c) v[c] = _mm512_loadu_ps(vt + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(pb[r][t]);
        for (int c = 0; c < DC; ++c) y[r][c] = _mm512_fmadd_ps(w, v[c], y[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < DC; ++c) _mm512_store_ps(accm[r] + 16 * c, y[r][c]);
  }
  for (int r = 0; r < R; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / sum[r]);
    for (int c = 0; c < DC; ++c)
      _mm512_storeu_ps(dst[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(accm[r] + 16 * c), inv));
  }
}

// the most rows decode_rows takes at once for a head dimension of 16 * DC: its sums in 24 registers
constexpr int max_rows(int dc) { return std::min(4, 24 / dc); }

template <int DC>
void decode_rows_n(int rows, const float* q, float* const* dst, const float* kp, const float* vp,
                   const int64_t* table, int64_t base, int64_t bs, int64_t lo, int64_t hi) {
  switch (rows) {
    case 1: return decode_rows<1, DC>(q, dst, kp, vp, table, base, bs, lo, hi);
    case 2: return decode_rows<2, DC>(q, dst, kp, vp, table, base, bs, lo, hi);
    case 3: return decode_rows<3, DC>(q, dst, kp, vp, table, base, bs, lo, hi);
    default: return decode_rows<max_rows(DC), DC>(q, dst, kp, vp, table, base, bs, lo, hi);
  }
}

// whether decode_rows is built for this head dimension
inline bool decode_path(int64_t dim) { return dim == 16 || dim == 32 || dim == 64 || dim == 128; }

// a decode task's rows (group of them), max_rows at a time; qs: the rows, prescaled
inline void decode_task(int64_t dim, int64_t group, const float* qs, float* const* dst, const float* kp,
                        const float* vp, const int64_t* table, int64_t base, int64_t bs, int64_t lo, int64_t hi) {
  const int step = max_rows(static_cast<int>(dim / 16));
  for (int64_t r0 = 0; r0 < group; r0 += step) {
    const int rows = static_cast<int>(std::min<int64_t>(step, group - r0));
    const float* q = qs + r0 * dim;
    float* const* d = dst + r0;
    switch (dim) {
      case 16: decode_rows_n<1>(rows, q, d, kp, vp, table, base, bs, lo, hi); break;
      case 32: decode_rows_n<2>(rows, q, d, kp, vp, table, base, bs, lo, hi); break;
      case 64: decode_rows_n<4>(rows, q, d, kp, vp, table, base, bs, lo, hi); break;
      default: decode_rows_n<8>(rows, q, d, kp, vp, table, base, bs, lo, hi); break;
    }
  }
}
#else
inline bool decode_path(int64_t) { return false; }
inline void decode_task(int64_t, int64_t, const float*, float* const*, const float*, const float*,
                        const int64_t*, int64_t, int64_t, int64_t, int64_t) {}
#endif

}  // namespace

// whether a decode (one query token) with this head dimension takes the register path (online softmax)
bool has_decode_path(int64_t dim) { return decode_path(dim); }

// one layer's new K/V into its pages: token i of key and value (kv_heads, T, D; any strides with D's
// stride 1) to slot slots[i] of k_pages and v_pages (kv_heads, slots, D; contiguous). What the store's
// index_copy_ does, as one call (for a decode step's few tokens most of index_copy_'s time was its own)
void write_kv(torch::Tensor k_pages, torch::Tensor v_pages, torch::Tensor slots, torch::Tensor key,
              torch::Tensor value) {
  TORCH_CHECK(k_pages.scalar_type() == at::kFloat && v_pages.scalar_type() == at::kFloat &&
                  key.scalar_type() == at::kFloat && value.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(k_pages.dim() == 3 && k_pages.is_contiguous() && v_pages.is_contiguous() &&
                  v_pages.sizes() == k_pages.sizes(),
              "pages: contiguous (kv_heads, slots, D), K and V alike");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key.stride(2) == 1 && value.stride(2) == 1,
              "key and value: (kv_heads, T, D) alike, with unit stride in D");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "slots: contiguous int64 (T,)");
  const int64_t kvh = k_pages.size(0), ns = k_pages.size(1), dim = k_pages.size(2), t = slots.size(0);
  TORCH_CHECK(key.size(0) == kvh && key.size(1) == t && key.size(2) == dim, "key/value shape ",
              key.sizes(), " against pages ", k_pages.sizes(), " and ", t, " slots");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < ns, "slot ", sp[i], " is outside the pages' ", ns, " slots");
  float* kp = k_pages.data_ptr<float>();
  float* vp = v_pages.data_ptr<float>();
  const float* ks = key.data_ptr<float>();
  const float* vs = value.data_ptr<float>();
  const int64_t kh_s = key.stride(0), kt_s = key.stride(1), vh_s = value.stride(0), vt_s = value.stride(1);
  at::parallel_for(0, kvh * t, 1024, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const int64_t h = j / t, i = j % t, dst = (h * ns + sp[i]) * dim;
      std::memcpy(kp + dst, ks + h * kh_s + i * kt_s, dim * sizeof(float));
      std::memcpy(vp + dst, vs + h * vh_s + i * vt_s, dim * sizeof(float));
    }
  });
}

// q, out: (T, heads, D), any strides with D's stride 1; k_pages, v_pages: (kv_heads, blocks,
// block_size, D) contiguous; rows, qlens, qstarts: (B,) the first packed row of each sequence, its
// query length, the position of its first query token; tables: (B, M) block ids. window <= 0: none.
void attend(torch::Tensor q, torch::Tensor out, torch::Tensor k_pages, torch::Tensor v_pages,
            torch::Tensor rows, torch::Tensor qlens, torch::Tensor qstarts, torch::Tensor tables,
            double scale, int64_t window, int64_t mode) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(k_pages.scalar_type() == at::kFloat && v_pages.scalar_type() == at::kFloat,
              "float32 pages only");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && q.stride(2) == 1 && out.stride(2) == 1,
              "q and out: (T, heads, D) with unit stride in D");
  TORCH_CHECK(k_pages.is_contiguous() && v_pages.is_contiguous() && k_pages.dim() == 4,
              "pages: contiguous (kv_heads, blocks, block_size, D)");
  TORCH_CHECK(tables.is_contiguous() && tables.dim() == 2, "tables: contiguous (B, M)");
  for (const auto& t : {rows, qlens, qstarts, tables})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "metadata: contiguous int64");
  const int64_t kvh = k_pages.size(0), nb = k_pages.size(1), bs = k_pages.size(2);
  const int64_t dim = k_pages.size(3), heads = q.size(1), batch = rows.size(0);
  const int64_t m = tables.size(1);
  TORCH_CHECK(heads % kvh == 0 && q.size(2) == dim && out.size(2) == dim, "bad head shapes");
  const int64_t group = heads / kvh;
  const int64_t qs_t = q.stride(0), qs_h = q.stride(1), os_t = out.stride(0), os_h = out.stride(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_pages.data_ptr<float>();
  const float* vp = v_pages.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = qlens.data_ptr<int64_t>();
  const int64_t* sp = qstarts.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const int64_t ntask = batch * kvh;
  const float inf = std::numeric_limits<float>::infinity();

#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t task = 0; task < ntask; ++task) {
    const int64_t b = task / kvh, kh = task % kvh;
    const int64_t ql = lp[b], q0 = sp[b], row0 = rp[b];
    const int64_t* table = tp + b * m;
    if (mode == 0 && decode_path(dim)) {
      // token by token: each token's rows of this KV head against the keys it sees
      thread_local std::vector<float> qbuf;
      thread_local std::vector<float*> dst;
      qbuf.resize(group * dim);
      dst.resize(group);
      for (int64_t j = 0; j < ql; ++j) {
        for (int64_t g = 0; g < group; ++g) {
          const float* src = qp + (row0 + j) * qs_t + (kh * group + g) * qs_h;
          for (int64_t d = 0; d < dim; ++d) qbuf[g * dim + d] = src[d] * sc;
          dst[g] = op + (row0 + j) * os_t + (kh * group + g) * os_h;
        }
        const int64_t hi = q0 + j + 1, lo = window > 0 ? std::max<int64_t>(0, hi - window) : 0;
        decode_task(dim, group, qbuf.data(), dst.data(), kp, vp, table, kh * nb, bs, lo, hi);
      }
      continue;
    }
    // query rows of this KV head: (token j, head g) -> row j * group + g
    const int64_t nrows = ql * group;
    // keys any row sees: [lo_all, hi_all)
    const int64_t hi_all = q0 + ql;
    const int64_t lo_all = window > 0 ? std::max<int64_t>(0, q0 + 1 - window) : 0;
    thread_local std::vector<float> buf;
    const int64_t span = hi_all - lo_all;
    const int64_t need = nrows * dim * 2 + nrows * 2 + (mode == 1 ? nrows * span : bs);
    if (static_cast<int64_t>(buf.size()) < need) buf.resize(need);
    float* qs = buf.data();
    float* acc = qs + nrows * dim;
    float* mx = acc + nrows * dim;
    float* sum = mx + nrows;
    float* scores = sum + nrows;
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t j = r / group, h = kh * group + r % group;
      const float* src = qp + (row0 + j) * qs_t + h * qs_h;
      for (int64_t d = 0; d < dim; ++d) qs[r * dim + d] = src[d] * sc;
      std::fill(acc + r * dim, acc + (r + 1) * dim, 0.0f);
      mx[r] = -inf;
      sum[r] = 0.0f;
    }
    const int64_t first = lo_all / bs, last = (hi_all + bs - 1) / bs;
    // keys of row r: [lo(r), hi(r))
    auto hi = [&](int64_t r) { return q0 + r / group + 1; };
    auto lo = [&](int64_t r) {
      return window > 0 ? std::max<int64_t>(0, q0 + r / group + 1 - window) : int64_t(0);
    };
    if (mode == 1) {
      // pass 1: every score of every row, scores[r * span + key - lo_all]
      for (int64_t blk = first; blk < last; ++blk) {
        const int64_t base = (kh * nb + table[blk]) * bs, t0 = blk * bs;
        for (int64_t r = 0; r < nrows; ++r) {
          const int64_t a = std::max(lo(r), t0), e = std::min(hi(r), t0 + bs);
          if (a < e)
            dots(scores + r * span + a - lo_all, qs + r * dim, kp + (base + a - t0) * dim, e - a,
                 dim);
        }
      }
      for (int64_t r = 0; r < nrows; ++r) {
        float* s = scores + r * span + lo(r) - lo_all;
        const int64_t n = hi(r) - lo(r);
        float top = -inf;
        for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
        mx[r] = top;
        sum[r] = exp_sub_sum(s, n, top);
      }
      // pass 2: the values, weighted
      for (int64_t blk = first; blk < last; ++blk) {
        const int64_t base = (kh * nb + table[blk]) * bs, t0 = blk * bs;
        for (int64_t r = 0; r < nrows; ++r) {
          const int64_t a = std::max(lo(r), t0), e = std::min(hi(r), t0 + bs);
          if (a < e)
            scale_add(acc + r * dim, 1.0f, scores + r * span + a - lo_all,
                      vp + (base + a - t0) * dim, e - a, dim);
        }
      }
    } else {
      // one pass: per block, each row's scores, its running max and sum, its rescaled values
      for (int64_t blk = first; blk < last; ++blk) {
        const int64_t base = (kh * nb + table[blk]) * bs, t0 = blk * bs;
        if (blk + 1 < last) prefetch_block(kp, vp, (kh * nb + table[blk + 1]) * bs * dim, bs * dim);
        for (int64_t r = 0; r < nrows; ++r) {
          const int64_t a = std::max(lo(r), t0), e = std::min(hi(r), t0 + bs);
          if (a >= e) continue;
          dots(scores, qs + r * dim, kp + (base + a - t0) * dim, e - a, dim);
          float top = mx[r];
          for (int64_t t = 0; t < e - a; ++t) top = std::max(top, scores[t]);
          // e^(old max - new max): 0 for the first block (old max -inf)
          const float c = mx[r] == -inf ? 0.0f : exp_clamped(mx[r] - top);
          const float add = exp_sub_sum(scores, e - a, top);
          sum[r] = sum[r] * c + add;
          mx[r] = top;
          scale_add(acc + r * dim, c, scores, vp + (base + a - t0) * dim, e - a, dim);
        }
      }
    }
    for (int64_t r = 0; r < nrows; ++r) {
      const int64_t j = r / group, h = kh * group + r % group;
      float* dst = op + (row0 + j) * os_t + h * os_h;
      const float inv = 1.0f / sum[r];
      for (int64_t d = 0; d < dim; ++d) dst[d] = acc[r * dim + d] * inv;
    }
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", torch::wrap_pybind_function(attend), "attend each sequence's queries over its K/V pages in place");
  m.def("has_decode_path", torch::wrap_pybind_function(has_decode_path), "whether the register (AVX-512) path serves this head dimension");
  m.def("write_kv", torch::wrap_pybind_function(write_kv), "one layer's new K/V into its pages");
}
