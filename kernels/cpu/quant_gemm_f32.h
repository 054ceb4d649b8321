// Many-row weight-only products in float32 (int4 or int8 codes, x as given) as a GEMM over
// panels of sixteen outputs, for quant_matmul.cc: with AVX-512 one register holds a panel's
// sixteen weights of an input, with AVX2 (and no AVX-512) two do.
//
// Why: products of more rows than the streaming path takes used to dequantize the whole weight
// into a float32 temporary for XLA's dot: for a tied LM head of 49152 x 576 that is 113 MB
// written and read back per step, which took about 60 % as long as XLA's dot on it. Here a panel's
// weights are dequantized once per call into a block that stays in cache (four bytes a weight,
// sixteen outputs wide), then every row of x multiplies it: several rows by sixteen outputs of
// FMAs per input, x broadcast. Same float32 arithmetic as the dequantized dot, in another order.
//
// Panel layout: input i's sixteen weights lie together, outputs n0 .. n0 + 16 in order (AVX2: as
// two 8-float vectors).
#pragma once

#include <cstring>
#include <vector>

#include "quant_dot.h"
#include "transpose.h"

#if JAXRUNNER_QUANT_DOT && (defined(__AVX512F__) || defined(__AVX2__))
#define JAXRUNNER_FLOAT_PANEL_GEMM 1

namespace jaxrunner_cpu {

constexpr int64_t kFloatPanelOutputs = 16;

// Output n's codes of run r: inputs 0..15 in lo, 16..31 in hi, a byte each; and the run's group's
// scale and offset.
template <bool kInt4>
inline void RunCodes(const QuantWeights& w, int64_t n, int64_t r, __m128i& lo, __m128i& hi, float& scale,
                     float& offset) {
  const int64_t runs = w.k / kRunInputs, g = n * w.groups + r / (runs / w.groups);
  scale = w.ValueAt(w.scales, g);
  offset = w.offsets == nullptr ? 0.0f : w.ValueAt(w.offsets, g);
  if constexpr (kInt4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.packed) + (n * runs + r) * 16));
    lo = _mm_and_si128(b, _mm_set1_epi8(15));
    hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
  } else {
    const int8_t* at = static_cast<const int8_t*>(w.packed) + (n * runs + r) * 32;
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16));
  }
}

#if defined(__AVX512F__)
constexpr int kFloatPanelRows = 8;  // rows per pass: 8 accumulators, one panel vector per input

struct FloatPanel {
  std::vector<__m512> w;  // [k]
};

// Outputs n0 .. n0 + count (count <= 16; missing ones zero) dequantized into panel: per run, the
// sixteen outputs' weights of each half transposed 16 x 16 so each input's sixteen lie together.
template <bool kInt4>
inline void PackFloatPanel(const QuantWeights& w, int64_t n0, int64_t count, FloatPanel& panel) {
  const int64_t runs = w.k / kRunInputs;
  panel.w.resize(w.k);
  for (int64_t r = 0; r < runs; ++r) {
    __m512i half[2][16];  // [inputs 0..15, 16..31][output]
    for (int64_t o = 0; o < 16; ++o) {
      half[0][o] = half[1][o] = _mm512_setzero_si512();
      if (o >= count) continue;
      __m128i codes[2];
      float scale, offset;
      RunCodes<kInt4>(w, n0 + o, r, codes[0], codes[1], scale, offset);
      for (int h = 0; h < 2; ++h) {
        const __m512i q = kInt4 ? _mm512_cvtepu8_epi32(codes[h]) : _mm512_cvtepi8_epi32(codes[h]);
        half[h][o] = _mm512_castps_si512(
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale), _mm512_set1_ps(offset)));
      }
    }
    for (int h = 0; h < 2; ++h) {
      Transpose16(half[h]);
      for (int j = 0; j < 16; ++j) panel.w[r * kRunInputs + 16 * h + j] = _mm512_castsi512_ps(half[h][j]);
    }
  }
}

// y[m0 + m, n0 .. n0 + count) for M rows of x [rows, k] from the panel.
template <int M>
inline void FloatPanelRows(const FloatPanel& panel, const float* x, int64_t k, int64_t m0, int64_t n, int64_t n0,
                           int64_t count, float* y) {
  __m512 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const __m512* w = panel.w.data();
  const float* rows = x + m0 * k;
  for (int64_t i = 0; i < k; ++i) {
    const __m512 wi = w[i];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(rows[m * k + i]), wi, acc[m]);
  }
  const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * n + n0, live, acc[m]);
}

#else  // AVX2
constexpr int kFloatPanelRows = 4;  // rows per pass: 8 accumulators (5 and 6 rows measured within noise of 4)

struct FloatPanel {
  std::vector<__m256> w;  // [k, 2]
};

// Output n's 32 weights of run r as four 8-float vectors, input order.
template <bool kInt4>
inline void DequantizeRun(const QuantWeights& w, int64_t n, int64_t r, __m256 v[4]) {
  __m128i lo, hi;
  float s, o;
  RunCodes<kInt4>(w, n, r, lo, hi, s, o);
  const __m256 scale = _mm256_set1_ps(s), offset = _mm256_set1_ps(o);
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

#endif

// The last `left` rows (fewer than kFloatPanelRows) from m0, in one pass.
template <int M>
inline void FloatPanelTail(const FloatPanel& panel, const float* x, int64_t k, int64_t m0, int64_t left, int64_t n,
                           int64_t n0, int64_t count, float* y) {
  if constexpr (M > 0) {
    if (left == M) return FloatPanelRows<M>(panel, x, k, m0, n, n0, count, y);
    FloatPanelTail<M - 1>(panel, x, k, m0, left, n, n0, count, y);
  }
}

// y[:, n0 .. n0 + count) (count <= 16) for every row of x: the panel dequantized once, then the
// rows kFloatPanelRows at a time.
template <bool kInt4>
inline void FloatPanelProduct(const QuantWeights& w, const float* x, int64_t rows, int64_t n0, int64_t count,
                              float* y) {
  thread_local FloatPanel panel;
  PackFloatPanel<kInt4>(w, n0, count, panel);
  int64_t m0 = 0;
  for (; m0 + kFloatPanelRows <= rows; m0 += kFloatPanelRows)
    FloatPanelRows<kFloatPanelRows>(panel, x, w.k, m0, w.n, n0, count, y);
  FloatPanelTail<kFloatPanelRows - 1>(panel, x, w.k, m0, rows - m0, w.n, n0, count, y);
}

}  // namespace jaxrunner_cpu

#endif
