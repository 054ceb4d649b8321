// Weight-only products as integer GEMMs over panels of sixteen outputs, with AVX512-VNNI: int4 or
// int8 codes times x rounded to 16 bits per run of 32 inputs (quant_dot.h's QuantizedX: the same
// integers, planes and sums as the few-row walk). quant_matmul.cc rearranges a weight as GGUF stores
// it into panels at every call (VnniPanel, many rows); quant_panels.cc reads a weight laid out as
// panels at load in place (StoredPanel, every row count).
//
// Why: the float32 panel (quant_gemm_f32.h) spends one FMA per input and sixteen outputs. Here
// one vpdpbusd multiplies four inputs of sixteen outputs by four bytes of x, broadcast: x's two
// int8 planes take two of them per four inputs, and where x is on an int8 grid ("w4a8",
// QuantizedX::OnePlane) one. A run's int32 sums are then scaled once, as in OutputDotPlanes.
//
// Panel layout: run r, quad j (inputs 4j .. 4j + 3) is one 64-byte vector whose dword o holds output
// n0 + o's four codes of those inputs, unsigned (int8 codes biased by 128, as BlockDot reads them).
// Per run, the sixteen outputs' scales, and for int4 their offsets, one lane each.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_dot.h"
#include "transpose.h"
#include "vec.h"

#if JAXRUNNER_QUANT_DOT_VNNI
#define JAXRUNNER_VNNI_GEMM 1

namespace jaxrunner_cpu {

constexpr int64_t kVnniPanelOutputs = 16;
constexpr int kVnniPanelRows = 8;  // rows per pass: 8 int32 and 8 float accumulators, 8 quads of codes

// A panel rearranged for one call (PackVnniPanel).
struct VnniPanel {
  std::vector<__m512i> codes;          // [runs, 8 quads]
  std::vector<__m512> scales, offsets;  // [runs]

  const __m512i* RunCodes(int64_t r, __m512i* /*scratch*/) const { return codes.data() + r * 8; }
  __m512 Scale(int64_t r) const { return scales[r]; }
  __m512 Offset(int64_t r) const { return offsets[r]; }
};

constexpr int64_t kStoredPanelAhead = 4096;  // how far ahead of the codes being read (StoredPanel)

// A panel of a weight laid out so at load (kernels/quant_panels.py), read in place (quant_panels.cc).
// Per run, int4: four 64-byte vectors, dword o of vector q holding output o's bytes 4q .. 4q + 3
// of the run (GGUF order: the low nibbles are inputs 4q .., the high ones 16 + 4q ..), split into
// the eight quads here; int8: the eight quads themselves, biased to unsigned at load. Per group,
// the sixteen outputs' scales (and offsets), one lane each, float16 or float32.
template <bool kInt4>
struct StoredPanel {
  const uint8_t* codes;  // [runs, kInt4 ? 4 : 8, 64]
  const void* scales;    // [groups, 16]
  const void* offsets;   // [groups, 16], or null
  bool half_scales;
  int64_t runs_per_group;

  const __m512i* RunCodes(int64_t r, __m512i* scratch) const {
    if constexpr (kInt4) {
      const uint8_t* at = codes + r * 256;
      Prefetch(at, 256);
      const __m512i nibble = _mm512_set1_epi8(15);
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(at + 64 * q);
        scratch[q] = _mm512_and_si512(v, nibble);
        scratch[4 + q] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    } else {
      Prefetch(codes + r * 512, 512);
      for (int j = 0; j < 8; ++j) scratch[j] = _mm512_loadu_si512(codes + r * 512 + 64 * j);
    }
    return scratch;
  }
  __m512 Scale(int64_t r) const { return Values(scales, r); }
  __m512 Offset(int64_t r) const { return offsets == nullptr ? _mm512_setzero_ps() : Values(offsets, r); }

 private:
  // The run's lines kStoredPanelAhead bytes on into L2 (PrefetchLine). A call's outputs are a few
  // contiguous streams, one per work item; without it one row read them at 0.75x the rate.
  static void Prefetch(const uint8_t* run, int64_t bytes) {
    for (int64_t at = 0; at < bytes; at += 64) PrefetchLine(reinterpret_cast<const char*>(run) + kStoredPanelAhead + at);
  }

  __m512 Values(const void* values, int64_t r) const {
    const int64_t at = (runs_per_group == 1 ? r : r / runs_per_group) * 16;  // no division per run for GGUF blocks
    if (half_scales) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(values) + at)));
    return _mm512_loadu_ps(static_cast<const float*>(values) + at);
  }
};

// Output n's 32 codes of run r as eight dwords of four unsigned bytes each, input order.
template <bool kInt4>
inline __m256i RunQuads(const QuantWeights& w, int64_t n, int64_t r) {
  const int64_t runs = w.k / kRunInputs;
  if constexpr (kInt4) {  // GGUF order: byte i holds input i (low nibble) and i + 16 (high)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(w.packed) + (n * runs + r) * 16));
    const __m128i nibble = _mm_set1_epi8(15);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(b, nibble)),
                                   _mm_and_si128(_mm_srli_epi16(b, 4), nibble), 1);
  } else {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(w.packed) + (n * runs + r) * 32));
    return _mm256_xor_si256(q, _mm256_set1_epi8(char(0x80)));
  }
}

// Outputs n0 .. n0 + count (count <= 16; missing ones zero) packed into panel: two runs at a
// time, each output's sixteen dwords (its quads of both runs) transposed 16 x 16.
template <bool kInt4>
inline void PackVnniPanel(const QuantWeights& w, int64_t n0, int64_t count, VnniPanel& panel) {
  const int64_t runs = w.k / kRunInputs, runs_per_group = runs / w.groups;
  panel.codes.resize(runs * 8);
  panel.scales.resize(runs);
  panel.offsets.resize(runs);
  for (int64_t r = 0; r < runs; r += 2) {
    __m512i rows[16];
    for (int64_t o = 0; o < 16; ++o) {
      if (o >= count) {
        rows[o] = _mm512_setzero_si512();
        continue;
      }
      const __m256i second = r + 1 < runs ? RunQuads<kInt4>(w, n0 + o, r + 1) : _mm256_setzero_si256();
      rows[o] = _mm512_inserti64x4(_mm512_castsi256_si512(RunQuads<kInt4>(w, n0 + o, r)), second, 1);
    }
    Transpose16(rows);
    for (int64_t j = 0; j < 16 && r * 8 + j < runs * 8; ++j) panel.codes[r * 8 + j] = rows[j];
  }
  for (int64_t r = 0; r < runs; ++r) {
    alignas(64) float scale[16] = {}, offset[16] = {};
    for (int64_t o = 0; o < count; ++o) {
      const int64_t g = (n0 + o) * w.groups + r / runs_per_group;
      scale[o] = w.ValueAt(w.scales, g);
      offset[o] = w.offsets == nullptr ? 0.0f : w.ValueAt(w.offsets, g);
    }
    panel.scales[r] = _mm512_load_ps(scale);
    panel.offsets[r] = _mm512_load_ps(offset);
  }
}

// Where row m's quad j of run r lies in plane 0 (high) or 1 (low) of x (QuantizedX::StorePlanes).
template <bool kInt4>
inline const int8_t* QuadOfX(const QuantizedX& x, int64_t m, int64_t r, int64_t j, int plane) {
  constexpr int64_t kRunsPerBlock = kInt4 ? 4 : 2;
  const int8_t* block = x.Planes(m, r / kRunsPerBlock);
  const int64_t in_block = r % kRunsPerBlock;
  if constexpr (kInt4) return block + 128 * (j / 4) + 64 * plane + 16 * in_block + 4 * (j % 4);
  return block + 64 * plane + 32 * in_block + 4 * j;
}

inline __m512i BroadcastQuad(const int8_t* at) {
  int32_t quad;
  std::memcpy(&quad, at, sizeof quad);
  return _mm512_set1_epi32(quad);
}

// Rows m0 .. m0 + M's int32 sums of run r with the panel's codes (kPlaneBase * high plane + low
// plane; the high plane alone with kOnePlane). Up to two rows, each plane's eight vpdpbusd run as
// two chains: one chain of sixteen left their latency exposed, and one row ran slower than the
// per-output walk on weights in cache.
template <int M, bool kInt4, bool kOnePlane>
inline void RunSums(const __m512i* codes, const QuantizedX& x, int64_t m0, int64_t r, __m512i* sums) {
  const auto quad = [&](int m, int j, int plane) { return BroadcastQuad(QuadOfX<kInt4>(x, m0 + m, r, j, plane)); };
  if constexpr (M <= 2) {
    __m512i high[2][M], low[2][M];
    for (int c = 0; c < 2; ++c)
      for (int m = 0; m < M; ++m) high[c][m] = low[c][m] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j)
      for (int m = 0; m < M; ++m) {
        high[j % 2][m] = _mm512_dpbusd_epi32(high[j % 2][m], codes[j], quad(m, j, 0));
        if constexpr (!kOnePlane) low[j % 2][m] = _mm512_dpbusd_epi32(low[j % 2][m], codes[j], quad(m, j, 1));
      }
    for (int m = 0; m < M; ++m) {
      sums[m] = _mm512_add_epi32(high[0][m], high[1][m]);
      if constexpr (!kOnePlane)
        sums[m] = _mm512_add_epi32(_mm512_slli_epi32(sums[m], 8), _mm512_add_epi32(low[0][m], low[1][m]));
    }
  } else {
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) sums[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) sums[m] = _mm512_dpbusd_epi32(sums[m], codes[j], quad(m, j, 0));
    }
    if constexpr (!kOnePlane) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) sums[m] = _mm512_slli_epi32(sums[m], 8);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) sums[m] = _mm512_dpbusd_epi32(sums[m], codes[j], quad(m, j, 1));
      }
    }
  }
}

// y[m0 + m, n0 .. n0 + count) for M rows of x from the panel. kOnePlane: the high planes alone,
// their sums scaled by kPlaneBase (x.OnePlane()).
template <int M, bool kInt4, bool kOnePlane, typename Panel>
inline void VnniPanelRows(const Panel& panel, const QuantizedX& x, int64_t m0, int64_t n, int64_t n0,
                          int64_t count, float* y) {
  __m512 acc[M];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const float plane_scale = kOnePlane ? float(kPlaneBase) : 1.0f;
  for (int64_t r = 0; r < x.runs(); ++r) {
    __m512i scratch[8];
    const __m512i* codes = panel.RunCodes(r, scratch);
    __m512i sums[M];
    RunSums<M, kInt4, kOnePlane>(codes, x, m0, r, sums);
    const __m512 scale = panel.Scale(r);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512 scale_dx = _mm512_mul_ps(scale, _mm512_set1_ps(x.Dx(m0 + m)[r]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[m]), _mm512_mul_ps(scale_dx, _mm512_set1_ps(plane_scale)), acc[m]);
      if constexpr (kInt4) acc[m] = _mm512_fmadd_ps(panel.Offset(r), _mm512_set1_ps(x.Sum(m0 + m)[r]), acc[m]);
      else acc[m] = _mm512_fmadd_ps(scale_dx, _mm512_set1_ps(x.Bias(m0 + m)[r]), acc[m]);
    }
  }
  const __mmask16 live = static_cast<__mmask16>((1u << count) - 1);
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * n + n0, live, acc[m]);
}

// The last `left` rows (fewer than kVnniPanelRows) from m0, in one pass.
template <int M, bool kInt4, bool kOnePlane, typename Panel>
inline void VnniPanelTail(const Panel& panel, const QuantizedX& x, int64_t m0, int64_t left, int64_t n,
                          int64_t n0, int64_t count, float* y) {
  if constexpr (M > 0) {
    if (left == M) return VnniPanelRows<M, kInt4, kOnePlane>(panel, x, m0, n, n0, count, y);
    VnniPanelTail<M - 1, kInt4, kOnePlane>(panel, x, m0, left, n, n0, count, y);
  }
}

template <bool kInt4, bool kOnePlane, typename Panel>
inline void VnniPanelPasses(const Panel& panel, const QuantizedX& x, int64_t rows, int64_t n, int64_t n0,
                            int64_t count, float* y) {
  int64_t m0 = 0;
  for (; m0 + kVnniPanelRows <= rows; m0 += kVnniPanelRows)
    VnniPanelRows<kVnniPanelRows, kInt4, kOnePlane>(panel, x, m0, n, n0, count, y);
  VnniPanelTail<kVnniPanelRows - 1, kInt4, kOnePlane>(panel, x, m0, rows - m0, n, n0, count, y);
}

// y[:, n0 .. n0 + count) (count <= 16) for every row of x: the panel packed once, then the rows
// kVnniPanelRows at a time.
template <bool kInt4>
inline void VnniPanelProduct(const QuantWeights& w, const QuantizedX& x, int64_t rows, int64_t n0, int64_t count,
                             float* y) {
  thread_local VnniPanel panel;
  PackVnniPanel<kInt4>(w, n0, count, panel);
  if (x.OnePlane()) VnniPanelPasses<kInt4, true>(panel, x, rows, w.n, n0, count, y);
  else VnniPanelPasses<kInt4, false>(panel, x, rows, w.n, n0, count, y);
}

}  // namespace jaxrunner_cpu

#endif
