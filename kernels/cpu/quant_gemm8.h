// Many-row "w4a8" products (int4 codes times x rounded to int8 per run of 32, quant_dot8.h) as a
// GEMM over panels of eight outputs, for quant_matmul.cc. AVX2 without AVX-512.
//
// Why: quant_dot8.h walks one output at a time, and its four runs' int16 sums meet in horizontal
// adds; that pays at a few rows, where the codes are read once from memory, but at tens of rows
// the product is bound by the multiplies and XLA's float32 dot was faster. Here a panel's codes
// are rearranged once (in L1) so that one vpmaddubsw multiplies four inputs of all eight outputs
// by the same four bytes of x, broadcast: the eight quads of a run add up in int16 lanes that
// already belong to one output each (at most 8 * 2 * 15 * 127 < 32768), and a single vpmaddwd,
// conversion and FMA finish the run. No horizontal adds, and every code unpacked once per call.
//
// Panel layout: run r, quad j (inputs 4j .. 4j + 3) is one 32-byte vector whose dword o holds output
// n0 + o's four codes of those inputs. Per run, the eight outputs' scales and offsets as floats.
// A work item is two panels (16 outputs) packed once, then every row of x, three rows at a time.
#pragma once

#include <cstring>

#include "quant_dot8.h"
#include "transpose.h"

#if JAXRUNNER_QUANT_DOT8
#define JAXRUNNER_QUANT_GEMM8 1

namespace jaxrunner_cpu {

constexpr int64_t kPanelOutputs = 8;
constexpr int kPanelRows = 3;  // rows of x per pass over two panels: 6 int16 sums and 6 accumulators live

// One panel's codes, scales and offsets, rearranged (see the top); reused for every row of x.
struct Panel8 {
  std::vector<__m256i> codes;            // [runs, 8 quads]
  std::vector<__m256> scales, offsets;   // [runs]
};

// Outputs n0 .. n0 + count (count <= 8; missing outputs get zero codes and scales) packed into panel.
inline void PackPanel8(const QuantWeights& w, int64_t n0, int64_t count, Panel8& panel) {
  const int64_t runs = w.k / kInt8Run, runs_per_group = runs / w.groups;
  panel.codes.resize(runs * 8);
  panel.scales.resize(runs);
  panel.offsets.resize(runs);
  const __m256i nibble = _mm256_set1_epi8(15);
  const uint8_t* packed = static_cast<const uint8_t*>(w.packed);
  for (int64_t r = 0; r < runs; ++r) {
    __m256i d[8];  // output o's 32 codes in input order: low nibbles (inputs 0..15), then high
    alignas(32) float scale[8] = {}, offset[8] = {};
    for (int64_t o = 0; o < 8; ++o) {
      if (o >= count) {
        d[o] = _mm256_setzero_si256();
        continue;
      }
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + ((n0 + o) * runs + r) * 16));
      d[o] = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1), nibble);
      const int64_t g = (n0 + o) * w.groups + r / runs_per_group;
      scale[o] = w.ValueAt(w.scales, g);
      offset[o] = w.offsets == nullptr ? 0.0f : w.ValueAt(w.offsets, g);
    }
    TransposeDwords(d, &panel.codes[r * 8]);
    panel.scales[r] = _mm256_load_ps(scale);
    panel.offsets[r] = _mm256_load_ps(offset);
  }
}

// y[m0 + m, n0 .. n0 + count) for M rows of x (bytes in input order) from two packed panels
// (outputs n0 .. n0 + 16): each broadcast quad of x serves both panels, each panel's codes M rows.
template <int M>
inline void PanelRows(const Panel8 panel[2], const QuantizedX8& x, int64_t m0, int64_t n, int64_t n0,
                      int64_t count, float* y) {
  const int64_t runs = x.runs();
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][M];
  for (int p = 0; p < 2; ++p)
    for (int m = 0; m < M; ++m) acc[p][m] = _mm256_setzero_ps();
  for (int64_t r = 0; r < runs; ++r) {
    __m256i sums[2][M];
    for (int p = 0; p < 2; ++p)
      for (int m = 0; m < M; ++m) sums[p][m] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 8; ++j) {  // unrolled fully, the compiler spilled the sums
      const __m256i c0 = _mm256_load_si256(&panel[0].codes[r * 8 + j]);
      const __m256i c1 = _mm256_load_si256(&panel[1].codes[r * 8 + j]);
      for (int m = 0; m < M; ++m) {
        int32_t quad;
        std::memcpy(&quad, x.Bytes(m0 + m) + r * kInt8Run + 4 * j, sizeof quad);
        const __m256i xq = _mm256_set1_epi32(quad);
        sums[0][m] = _mm256_add_epi16(sums[0][m], _mm256_maddubs_epi16(c0, xq));
        sums[1][m] = _mm256_add_epi16(sums[1][m], _mm256_maddubs_epi16(c1, xq));
      }
    }
    for (int m = 0; m < M; ++m) {
      const __m256 dx = _mm256_set1_ps(x.Dx(m0 + m)[r]), sum = _mm256_set1_ps(x.Sum(m0 + m)[r]);
      for (int p = 0; p < 2; ++p) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(sums[p][m], ones));
        acc[p][m] = _mm256_fmadd_ps(dot, _mm256_mul_ps(panel[p].scales[r], dx), acc[p][m]);
        acc[p][m] = _mm256_fmadd_ps(panel[p].offsets[r], sum, acc[p][m]);
      }
    }
  }
  alignas(32) float lanes[M][2 * kPanelOutputs];  // unrolled: see quant_gemm_f32.h
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m) {
    _mm256_store_ps(lanes[m], acc[0][m]);
    _mm256_store_ps(lanes[m] + kPanelOutputs, acc[1][m]);
  }
  for (int m = 0; m < M; ++m) std::memcpy(y + (m0 + m) * n + n0, lanes[m], count * sizeof(float));
}

// y[:, n0 .. n0 + count) (count <= 16) for every row of x: two panels packed once, then the rows
// three at a time (two panels by three rows measured fastest of the tiles tried, 1 x 4 to 3 x 2).
inline void PanelProduct(const QuantWeights& w, const QuantizedX8& x, int64_t rows, int64_t n0, int64_t count,
                         float* y) {
  thread_local Panel8 panel[2];
  PackPanel8(w, n0, std::min(count, kPanelOutputs), panel[0]);
  PackPanel8(w, n0 + kPanelOutputs, std::max<int64_t>(count - kPanelOutputs, 0), panel[1]);
  int64_t m0 = 0;
  for (; m0 + kPanelRows <= rows; m0 += kPanelRows) PanelRows<kPanelRows>(panel, x, m0, w.n, n0, count, y);
  switch (rows - m0) {
    case 2: PanelRows<2>(panel, x, m0, w.n, n0, count, y); break;
    case 1: PanelRows<1>(panel, x, m0, w.n, n0, count, y); break;
    default: break;
  }
}

}  // namespace jaxrunner_cpu

#endif
