// Few-row quantized products as integer dot products (AVX512-VNNI), for quant_matmul.cc.
//
// Why: a batch-1 decode should run at the memory's rate, but turning int4 codes into float32
// weights and multiplying them in float32 takes about eight vector instructions per 32 weights.
// On a CPU that runs each 512-bit instruction as two 256-bit halves (AMD Zen 4), that ran at about
// half the memory's rate. vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and adds them
// in fours into sixteen int32 lanes: about three instructions per 32 weights here.
//
// What it computes: x is rounded, per run of 32 inputs, to 16-bit integers scaled to the run's
// largest magnitude, x ~ dx * (256 * hi + lo) with hi and lo int8 planes. The rounding error of an
// input is at most max|x over its run| / 65024, a few hundred times finer than bfloat16
// activations; the codes' products with the planes are summed exactly in int32, then scaled by
// (weight scale * dx) in float32. Offsets (int4) multiply the exact float sums of x; int8 codes
// are read biased to unsigned (q + 128) and the bias's products are subtracted exactly.
//
// Layouts: an int4 run is 16 bytes (GGUF order: low nibbles are inputs 0..15, high nibbles
// 16..31), so one 64-byte block holds 4 runs and int32 lane j belongs to run j / 4; x's planes
// for a block are [hi of inputs 0..15 of each run, lo of those, hi of inputs 16..31, lo of those].
// An int8 run is 32 bytes, a block holds 2 runs, lane j belongs to run j / 8, and the planes are
// [hi, lo] in input order.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXRUNNER_QUANT_DOT_VNNI 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace jaxrunner_cpu {

constexpr int64_t kRunInputs = 32;
constexpr float kX16Max = 32512.0f;  // |256 * hi + lo| with hi in [-127, 127] and lo in [-128, 127]

// The quantized weight of one product, as quant_matmul.cc describes it.
struct QuantWeights {
  const void* packed;
  const void* scales;
  const void* offsets;  // or null
  bool half_scales, int4;
  int64_t n, k, groups;

  float ValueAt(const void* values, int64_t i) const {  // a scale or offset, float16 or float32
    return half_scales ? HalfToF32(static_cast<const uint16_t*>(values)[i]) : static_cast<const float*>(values)[i];
  }
};

// x [rows, k] as int8 planes per block, with per-run dx, float sums, and the int8 bias term.
class QuantizedX {
 public:
  QuantizedX(const float* x, int64_t rows, int64_t k, bool int4)
      : runs_(k / kRunInputs), chunks_((runs_ + 15) / 16), int4_(int4),
        runs_per_block_(int4 ? 4 : 2), blocks_((runs_ + runs_per_block_ - 1) / runs_per_block_),
        planes_(rows * blocks_ * 256, 0), dx_(rows * chunks_ * 16, 0.0f), sum_(dx_.size(), 0.0f),
        bias_(dx_.size(), 0.0f) {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t r = 0; r < runs_; ++r) QuantizeRun(x + m * k + r * kRunInputs, m, r);
  }

  int64_t runs() const { return runs_; }
  const int8_t* Planes(int64_t m, int64_t block) const { return planes_.data() + (m * blocks_ + block) * 256; }
  __m512 Dx(int64_t m, int64_t chunk) const { return _mm512_loadu_ps(dx_.data() + (m * chunks_ + chunk) * 16); }
  __m512 Sum(int64_t m, int64_t chunk) const { return _mm512_loadu_ps(sum_.data() + (m * chunks_ + chunk) * 16); }
  __m512 Bias(int64_t m, int64_t chunk) const { return _mm512_loadu_ps(bias_.data() + (m * chunks_ + chunk) * 16); }

 private:
  void QuantizeRun(const float* x, int64_t m, int64_t r) {
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    const float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float dx = peak > 0.0f ? peak / kX16Max : 1.0f;
    const __m512 inverse = _mm512_set1_ps(peak > 0.0f ? kX16Max / peak : 0.0f);
    const __m512i va = _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse));  // round to nearest even
    const __m512i vb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse));
    const int64_t slot = m * chunks_ * 16 + r;
    dx_[slot] = dx;
    sum_[slot] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    bias_[slot] = -128.0f * float(_mm512_reduce_add_epi32(_mm512_add_epi32(va, vb)));
    int8_t* planes = planes_.data() + (m * blocks_ + r / runs_per_block_) * 256;
    const int64_t j = r % runs_per_block_;
    if (int4_) {  // inputs 0..15 -> planes 0 and 1, inputs 16..31 -> planes 2 and 3, at 16 * j
      StoreSplit(va, planes + 16 * j, planes + 64 + 16 * j);
      StoreSplit(vb, planes + 128 + 16 * j, planes + 192 + 16 * j);
    } else {  // inputs in order: planes 0 and 1, at 32 * j
      StoreSplit(va, planes + 32 * j, planes + 64 + 32 * j);
      StoreSplit(vb, planes + 32 * j + 16, planes + 64 + 32 * j + 16);
    }
  }

  // v = 256 * hi + lo, hi = (v + 128) >> 8 (floor), lo = v - 256 * hi in [-128, 127].
  static void StoreSplit(__m512i v, int8_t* hi_out, int8_t* lo_out) {
    const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(v, _mm512_set1_epi32(128)), 8);
    const __m512i lo = _mm512_sub_epi32(v, _mm512_slli_epi32(hi, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi_out), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo_out), _mm512_cvtepi32_epi8(lo));
  }

  int64_t runs_, chunks_;
  bool int4_;
  int64_t runs_per_block_, blocks_;
  std::vector<int8_t> planes_;           // [rows, blocks, 4 (int4) or 2 used of 4, 64]
  std::vector<float> dx_, sum_, bias_;  // [rows, chunks * 16]
};

// The weight scales (or offsets) of `count` runs from run `first` of output n, one per lane.
inline __m512 RunValues(const QuantWeights& w, const void* values, int64_t n, int64_t first, int64_t count) {
  const int64_t runs = w.k / kRunInputs, runs_per_group = runs / w.groups;
  const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  if (runs_per_group == 1) {  // one scale per run (GGUF blocks, int4 groups of 32)
    const int64_t at = n * w.groups + first;
    if (w.half_scales) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(values) + at));
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(values) + at);
  }
  if (w.groups == 1) {  // one scale per output (per-channel int8)
    return _mm512_maskz_mov_ps(mask, _mm512_set1_ps(w.ValueAt(values, n)));
  }
  alignas(64) float lanes[16] = {};
  for (int64_t j = 0; j < count; ++j) lanes[j] = w.ValueAt(values, n * w.groups + (first + j) / runs_per_group);
  return _mm512_load_ps(lanes);
}

// The int32 sums of one block's codes with row m's planes, each lane four products.
template <bool kInt4>
inline __m512i BlockDot(__m512i codes, const int8_t* planes) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i hi, lo;
  if constexpr (kInt4) {
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i low = _mm512_and_si512(codes, nibble), high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
    hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, _mm512_loadu_si512(planes)), high,
                             _mm512_loadu_si512(planes + 128));
    lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, _mm512_loadu_si512(planes + 64)), high,
                             _mm512_loadu_si512(planes + 192));
  } else {
    const __m512i biased = _mm512_xor_si512(codes, _mm512_set1_epi8(char(0x80)));
    hi = _mm512_dpbusd_epi32(zero, biased, _mm512_loadu_si512(planes));
    lo = _mm512_dpbusd_epi32(zero, biased, _mm512_loadu_si512(planes + 64));
  }
  return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
}

// Asks for output n's codes and scales a few kilobytes before they are read. Without it the
// integer dot products waited on memory: one row is a few hundred bytes of codes in three streams
// (codes, scales, offsets), and the SmolLM2 batch-1 int4 step took 14-15 ms without it and
// 10-11 ms with it (two alternating pairs of the latency benchmark).
inline void PrefetchOutput(const QuantWeights& w, int64_t n) {
  const int64_t row_bytes = w.int4 ? w.k / 2 : w.k, scale_bytes = w.groups * (w.half_scales ? 2 : 4);
  const char* codes = static_cast<const char*>(w.packed) + n * row_bytes;
  for (int64_t at = 0; at < row_bytes; at += 64) PrefetchLineL1(codes + at);
  for (const void* values : {w.scales, w.offsets})
    if (values != nullptr)
      for (int64_t at = 0; at < scale_bytes; at += 64)
        PrefetchLineL1(static_cast<const char*>(values) + n * scale_bytes + at);
}

constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of the codes being read

// y[m * w.n + n] for the M rows of x and output n.
template <int M, bool kInt4>
void OutputVnni(const QuantWeights& w, const QuantizedX& x, int64_t n, float* y) {
  constexpr int64_t kRunsPerBlock = kInt4 ? 4 : 2, kRowBytes = kInt4 ? 16 : 32;
  const uint8_t* codes = static_cast<const uint8_t*>(w.packed) + n * (w.k / kRunInputs) * kRowBytes;
  const __m512i lane_run = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             kInt4 ? 2 : 3);  // which run of the block a lane belongs to
  const int64_t runs = x.runs(), ahead = n + std::max<int64_t>(1, kPrefetchBytes / (runs * kRowBytes));
  if (ahead < w.n) PrefetchOutput(w, ahead);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t first = 0, chunk = 0; first < runs; first += 16, ++chunk) {
    const int64_t count = std::min<int64_t>(16, runs - first);
    const __m512 scale = RunValues(w, w.scales, n, first, count);
    __m512 scale_dx[M];
    for (int m = 0; m < M; ++m) {
      scale_dx[m] = _mm512_mul_ps(scale, x.Dx(m, chunk));
      if constexpr (kInt4) {
        if (w.offsets != nullptr) acc[m] = _mm512_fmadd_ps(RunValues(w, w.offsets, n, first, count), x.Sum(m, chunk), acc[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(scale_dx[m], x.Bias(m, chunk), acc[m]);
      }
    }
    for (int64_t r = 0; r < count; r += kRunsPerBlock) {
      const int64_t block = (first + r) / kRunsPerBlock, bytes = std::min<int64_t>(64, (count - r) * kRowBytes);
      const uint8_t* at = codes + block * 64;
      const __m512i v = bytes == 64 ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8((__mmask64(1) << bytes) - 1, at);
      const __m512i lanes = _mm512_add_epi32(lane_run, _mm512_set1_epi32(int32_t(r)));
      for (int m = 0; m < M; ++m) {
        const __m512 dot = _mm512_cvtepi32_ps(BlockDot<kInt4>(v, x.Planes(m, block)));
        acc[m] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lanes, scale_dx[m]), acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) y[m * w.n + n] = _mm512_reduce_add_ps(acc[m]);
}

}  // namespace jaxrunner_cpu

#endif
