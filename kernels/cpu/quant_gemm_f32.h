// Many-row weight-only products in float32 (int4 or int8 codes, x as given) as a GEMM over
// panels of sixteen outputs, for quant_matmul.cc. AVX2 without AVX-512, like quant_gemm8.h.
//
// Why: products of more rows than the streaming path takes used to dequantize the whole weight
// into a float32 temporary for XLA's dot: for a tied LM head of 49152 x 576 that is 113 MB
// written and read back per step, which took about 60 % as long as XLA's dot on it. Here a panel's
// weights are dequantized once per call into a block that stays in cache (four bytes a weight,
// sixteen outputs wide), then every row of x multiplies it: four rows by sixteen outputs of FMAs
// per input, x broadcast. Same float32 arithmetic as the dequantized dot, in another order.
//
// Panel layout: input i is two 8-float vectors, outputs n0 .. n0 + 8 and n0 + 8 .. n0 + 16.
#pragma once

#include "quant_gemm8.h"

#if JAXRUNNER_QUANT_GEMM8

namespace jaxrunner_cpu {

constexpr int64_t kFloatPanelOutputs = 16;
constexpr int kFloatPanelRows = 4;  // rows per pass: 8 accumulators (5 and 6 rows measured within noise of 4)

struct FloatPanel {
  std::vector<__m256> w;  // [k, 2]
};

// Output n's 32 weights of run r as four 8-float vectors, input order.
template <bool kInt4>
inline void DequantizeRun(const QuantWeights& w, int64_t n, int64_t r, __m256 v[4]) {
  const int64_t runs = w.k / kRunInputs, g = n * w.groups + r / (runs / w.groups);
  const __m256 scale = _mm256_set1_ps(w.ValueAt(w.scales, g));
  const __m256 offset = _mm256_set1_ps(w.offsets == nullptr ? 0.0f : w.ValueAt(w.offsets, g));
  __m128i lo, hi;  // the run's codes, inputs 0..15 and 16..31, as bytes
  if constexpr (kInt4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.packed) + (n * runs + r) * 16));
    lo = _mm_and_si128(b, _mm_set1_epi8(15));
    hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
  } else {
    const int8_t* at = static_cast<const int8_t*>(w.packed) + (n * runs + r) * 32;
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16));
  }
  const auto widen = [&](__m128i bytes) {
    const __m256i words = kInt4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(words), scale, offset);
  };
  v[0] = widen(lo);
  v[1] = widen(_mm_srli_si128(lo, 8));
  v[2] = widen(hi);
  v[3] = widen(_mm_srli_si128(hi, 8));
}

// Outputs n0 .. n0 + count (count <= 16; missing ones zero) dequantized into panel: per run and
// half, eight outputs' weights transposed 8 x 8 so each input's eight weights lie together.
template <bool kInt4>
inline void PackFloatPanel(const QuantWeights& w, int64_t n0, int64_t count, FloatPanel& panel) {
  const int64_t runs = w.k / kRunInputs;
  panel.w.resize(w.k * 2);
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t r = 0; r < runs; ++r) {
      __m256 v[4][8];  // [8 inputs of the run][output]
      for (int64_t o = 0; o < 8; ++o) {
        __m256 run[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        if (8 * half + o < count) DequantizeRun<kInt4>(w, n0 + 8 * half + o, r, run);
        for (int b = 0; b < 4; ++b) v[b][o] = run[b];
      }
      for (int b = 0; b < 4; ++b) {
        __m256i inputs[8];
        TransposeDwords(reinterpret_cast<const __m256i*>(v[b]), inputs);
        for (int j = 0; j < 8; ++j) panel.w[(r * kRunInputs + 8 * b + j) * 2 + half] = _mm256_castsi256_ps(inputs[j]);
      }
    }
}

// y[m0 + m, n0 .. n0 + count) for M rows of x [rows, k] from the panel.
template <int M>
inline void FloatPanelRows(const FloatPanel& panel, const float* x, int64_t k, int64_t m0, int64_t n, int64_t n0,
                           int64_t count, float* y) {
  __m256 lo[M], hi[M];  // outputs n0 .. n0 + 8 and n0 + 8 .. n0 + 16 of each row
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  const __m256* w = panel.w.data();
  const float* rows = x + m0 * k;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = w[2 * i], w1 = w[2 * i + 1];
    for (int m = 0; m < M; ++m) {
      const __m256 xi = _mm256_broadcast_ss(rows + m * k + i);
      lo[m] = _mm256_fmadd_ps(xi, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(xi, w1, hi[m]);
    }
  }
  // Unrolled, so the accumulators stay registers: GCC otherwise kept them in memory and stored
  // them at every input (half the rate).
  alignas(32) float lanes[M][kFloatPanelOutputs];
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm256_store_ps(lanes[m], lo[m]);
    _mm256_store_ps(lanes[m] + 8, hi[m]);
  }
  for (int m = 0; m < M; ++m) std::memcpy(y + (m0 + m) * n + n0, lanes[m], count * sizeof(float));
}

// y[:, n0 .. n0 + count) (count <= 16) for every row of x: the panel dequantized once, then the
// rows four at a time.
template <bool kInt4>
inline void FloatPanelProduct(const QuantWeights& w, const float* x, int64_t rows, int64_t n0, int64_t count,
                              float* y) {
  thread_local FloatPanel panel;
  PackFloatPanel<kInt4>(w, n0, count, panel);
  int64_t m0 = 0;
  for (; m0 + kFloatPanelRows <= rows; m0 += kFloatPanelRows)
    FloatPanelRows<kFloatPanelRows>(panel, x, w.k, m0, w.n, n0, count, y);
  switch (rows - m0) {
    case 3: FloatPanelRows<3>(panel, x, w.k, m0, w.n, n0, count, y); break;
    case 2: FloatPanelRows<2>(panel, x, w.k, m0, w.n, n0, count, y); break;
    case 1: FloatPanelRows<1>(panel, x, w.k, m0, w.n, n0, count, y); break;
    default: break;
  }
}

}  // namespace jaxrunner_cpu

#endif
