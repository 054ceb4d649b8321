// Few-row quantized products as integer dot products, for quant_matmul.cc: AVX512-VNNI or AVX2.
//
// Why: a batch-1 decode should run at the memory's rate, but turning int4 codes into float32
// weights and multiplying them in float32 takes about eight vector instructions per 32 weights.
// On a CPU that runs each 512-bit instruction as two 256-bit halves (AMD Zen 4), that ran at about
// half the memory's rate. vpdpbusd multiplies 64 unsigned bytes by 64 signed bytes and adds them
// in fours into sixteen int32 lanes: about three instructions per 32 weights here. AVX2 has no
// vpdpbusd, and where each 256-bit instruction runs as two 128-bit halves (AMD Zen 1 and 2) the
// float form was compute-bound too; there the codes widen to 16 bits with shifts and masks, and
// vpmaddwd multiplies them by x rounded to 16 bits, adding pairs into int32: the fewest
// multiplies of the forms tried, and the same sums.
//
// What it computes: x is rounded, per run of 32 inputs, to 16-bit integers scaled to the run's
// largest magnitude (at most kX16Max). The rounding error of an input is at most
// max|x over its run| / 65024, a few hundred times finer than bfloat16 activations; the codes'
// products with them are summed exactly in int32, then scaled by (weight scale * dx) in float32.
// Offsets (int4) multiply the exact float sums of x. VNNI splits the integers into int8 planes,
// x ~ dx * (256 * hi + lo), and reads int8 codes biased to unsigned (q + 128), subtracting the
// bias's products exactly. AVX2 keeps the integers as int16 words and widens int8 codes with
// their signs.
//
// Layouts: an int4 run is 16 bytes (GGUF order: low nibbles are inputs 0..15, high nibbles
// 16..31), so one 64-byte block holds 4 runs; an int8 run is 32 bytes, a block holds 2 runs.
// VNNI: int32 lane j belongs to run j / 4 (int4) or j / 8 (int8); x's planes for an int4 block are
// [hi of inputs 0..15 of each run, lo of those, hi of inputs 16..31, lo of those], for an int8
// block [hi, lo] in input order. AVX2 reads a block as two halves of 32 bytes; x's words follow
// the order the codes widen in (QuantizedX::StoreWords).
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define JAXRUNNER_QUANT_DOT 1
#define JAXRUNNER_QUANT_DOT_VNNI 1
// AVX-512 without VNNI keeps quant_matmul.cc's float forms (its int4 table lookup), measured
// there; this form was not.
#elif defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define JAXRUNNER_QUANT_DOT 1
#define JAXRUNNER_QUANT_DOT_AVX2 1
#endif

#if JAXRUNNER_QUANT_DOT

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace jaxrunner_cpu {

constexpr int64_t kRunInputs = 32;
constexpr float kX16Max = 32512.0f;  // the rounded inputs' largest magnitude: 256 * 127 + 0, in int16
#if JAXRUNNER_QUANT_DOT_VNNI
constexpr int32_t kPlaneBase = 256;  // x ~ dx * (kPlaneBase * hi + lo), lo in [-128, 127]
#endif

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

// x [rows, k] rounded to 16-bit integers per run (int8 planes with VNNI, int16 words with AVX2),
// 256 bytes per block, with per-run dx, float sums, and VNNI's int8 bias term.
class QuantizedX {
 public:
  QuantizedX(const float* x, int64_t rows, int64_t k, bool int4)
      : runs_(k / kRunInputs), chunks_((runs_ + 15) / 16), int4_(int4),
        runs_per_block_(int4 ? 4 : 2), blocks_((runs_ + runs_per_block_ - 1) / runs_per_block_),
        data_(rows * blocks_ * 256, 0), dx_(rows * chunks_ * 16, 0.0f), sum_(dx_.size(), 0.0f),
        bias_(dx_.size(), 0.0f) {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t r = 0; r < runs_; ++r) QuantizeRun(x + m * k + r * kRunInputs, m, r);
#if JAXRUNNER_QUANT_DOT_VNNI
    one_plane_ = LowPlanesZero();
#endif
  }

  int64_t runs() const { return runs_; }
#if JAXRUNNER_QUANT_DOT_VNNI
  // Whether every low plane is zero: x was on an int8 grid per run ("w4a8" rounds it so), which
  // the 16-bit rounding keeps exactly as 256 q, so the high planes alone carry it (OutputDotPlanes).
  bool OnePlane() const { return one_plane_; }
#endif
  const int8_t* Planes(int64_t m, int64_t block) const { return data_.data() + (m * blocks_ + block) * 256; }
  const int16_t* Words(int64_t m, int64_t block) const { return reinterpret_cast<const int16_t*>(Planes(m, block)); }
  // Row m's per-run values, padded with zeros to a multiple of 16 runs.
  const float* Dx(int64_t m) const { return dx_.data() + m * chunks_ * 16; }
  const float* Sum(int64_t m) const { return sum_.data() + m * chunks_ * 16; }
  const float* Bias(int64_t m) const { return bias_.data() + m * chunks_ * 16; }

 private:
  void QuantizeRun(const float* x, int64_t m, int64_t r) {
    alignas(64) int32_t v[kRunInputs];
    float peak, sum;
    Round(x, v, peak, sum);
    const int64_t slot = m * chunks_ * 16 + r;
    dx_[slot] = peak > 0.0f ? peak / kX16Max : 1.0f;
    sum_[slot] = sum;
    int8_t* block = data_.data() + (m * blocks_ + r / runs_per_block_) * 256;
#if JAXRUNNER_QUANT_DOT_VNNI
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_load_si512(v), _mm512_load_si512(v + 16)));
    bias_[slot] = -128.0f * float(total);
    StorePlanes(v, r % runs_per_block_, block);
#else
    StoreWords(v, r % runs_per_block_, reinterpret_cast<int16_t*>(block));
#endif
  }

#if JAXRUNNER_QUANT_DOT_VNNI
  // Whether every block's low planes are zero: bytes 64..127, and for int4 192..255 (StorePlanes).
  bool LowPlanesZero() const {
    const int64_t low_planes = int4_ ? 2 : 1;
    for (size_t block = 0; block < data_.size(); block += 256)
      for (int64_t p = 0; p < low_planes; ++p) {
        const __m512i plane = _mm512_loadu_si512(data_.data() + block + 64 + 128 * p);
        if (_mm512_test_epi8_mask(plane, plane) != 0) return false;
      }
    return true;
  }

  // Run j of a block as int8 planes, v = kPlaneBase * hi + lo.
  void StorePlanes(const int32_t* v, int64_t j, int8_t* planes) const {
    if (int4_) {  // inputs 0..15 -> planes 0 and 1, inputs 16..31 -> planes 2 and 3, at 16 * j
      Split(v, planes + 16 * j, planes + 64 + 16 * j);
      Split(v + 16, planes + 128 + 16 * j, planes + 192 + 16 * j);
    } else {  // inputs in order: planes 0 and 1, at 32 * j
      Split(v, planes + 32 * j, planes + 64 + 32 * j);
      Split(v + 16, planes + 32 * j + 16, planes + 64 + 32 * j + 16);
    }
  }

  // 16 values v = kPlaneBase * hi + lo, hi = floor((v + kPlaneBase / 2) / kPlaneBase): an
  // arithmetic shift floors.
  static void Split(const int32_t* v, int8_t* hi_out, int8_t* lo_out) {
    static_assert(kPlaneBase == 256, "the shift below divides by 256");
    const __m512i words = _mm512_loadu_si512(v);
    const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(words, _mm512_set1_epi32(kPlaneBase / 2)), 8);
    const __m512i lo = _mm512_sub_epi32(words, _mm512_slli_epi32(hi, 8));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi_out), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo_out), _mm512_cvtepi32_epi8(lo));
  }
#else
  // Run j of a block as int16 words in the order AVX2 widens the codes (see PairDot, RunDotInt8):
  // int4, runs 2p and 2p + 1 share 4 vectors at 64 p, the first run's half of each at 0, the
  // second's at 8, and word w of vector t is input 2w, 16 + 2w, 2w + 1 or 17 + 2w; int8, run j is
  // 2 vectors at 32 j, the even inputs then the odd ones.
  void StoreWords(const int32_t* v, int64_t j, int16_t* block) const {
    if (int4_) {
      constexpr int kFirst[4] = {0, 16, 1, 17};
      int16_t* pair = block + 64 * (j / 2) + 8 * (j % 2);
      for (int t = 0; t < 4; ++t)
        for (int w = 0; w < 8; ++w) pair[16 * t + w] = int16_t(v[kFirst[t] + 2 * w]);
    } else {
      for (int w = 0; w < 16; ++w) {
        block[32 * j + w] = int16_t(v[2 * w]);
        block[32 * j + 16 + w] = int16_t(v[2 * w + 1]);
      }
    }
  }
#endif

  // The 32 inputs at x rounded to integers scaled to their largest magnitude (to nearest even),
  // with that magnitude and their float sum.
  static void Round(const float* x, int32_t* v, float& peak, float& sum) {
#if JAXRUNNER_QUANT_DOT_VNNI
    const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
    peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    const __m512 inverse = _mm512_set1_ps(peak > 0.0f ? kX16Max / peak : 0.0f);
    _mm512_store_si512(v, _mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)));
    _mm512_store_si512(v + 16, _mm512_cvtps_epi32(_mm512_mul_ps(b, inverse)));
#else
    __m256 part[4], magnitude = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; ++i) {
      part[i] = _mm256_loadu_ps(x + 8 * i);
      magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, part[i]));
      total = _mm256_add_ps(total, part[i]);
    }
    alignas(32) float lanes[8], sums[8];
    _mm256_store_ps(lanes, magnitude);
    _mm256_store_ps(sums, total);
    peak = *std::max_element(lanes, lanes + 8);
    sum = 0.0f;
    for (float s : sums) sum += s;
    const __m256 inverse = _mm256_set1_ps(peak > 0.0f ? kX16Max / peak : 0.0f);
    for (int i = 0; i < 4; ++i)
      _mm256_store_si256(reinterpret_cast<__m256i*>(v + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inverse)));
#endif
  }

  int64_t runs_, chunks_;
  bool int4_;
  int64_t runs_per_block_, blocks_;
  std::vector<int8_t> data_;            // [rows, blocks, 256 bytes]: planes or words
  std::vector<float> dx_, sum_, bias_;  // [rows, chunks * 16]; bias_ zeros on AVX2, which reads none
#if JAXRUNNER_QUANT_DOT_VNNI
  bool one_plane_ = false;
#endif
};

// Asks for output n's codes and scales a few kilobytes before they are read. Without it the
// integer dot products waited on memory: one row is a few hundred bytes of codes in three streams
// (codes, scales, offsets), and the SmolLM2 batch-1 int4 step took 14-15 ms without it and
// 10-11 ms with it (two alternating pairs of the latency benchmark). The AVX2 form's int4 walk
// goes without it (OutputSums): on an AVX2 EPYC its prefetches cost a sixth of one core's rate on
// weights in cache and gained nothing from memory on both cores, and w4a8's batch-1 TPOT was 6 %
// better without them (three of four alternating pairs; int4's within noise). The int8 head still
// reads faster with them.
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

// The output after n whose codes to prefetch now.
inline int64_t PrefetchAhead(const QuantWeights& w, int64_t n) {
  const int64_t row_bytes = w.int4 ? w.k / 2 : w.k;
  return n + std::max<int64_t>(1, kPrefetchBytes / row_bytes);
}

#if JAXRUNNER_QUANT_DOT_VNNI
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

// The int32 sums of one block's codes with row m's planes, each lane four products. kOnePlane:
// the high plane's sums alone (x.OnePlane()), 1 / kPlaneBase of the full sums, with half the
// multiplies; OutputDot scales them back.
template <bool kInt4, bool kOnePlane>
inline __m512i BlockDot(__m512i codes, const int8_t* planes) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i hi, lo;
  if constexpr (kInt4) {
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i low = _mm512_and_si512(codes, nibble), high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), nibble);
    hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, _mm512_loadu_si512(planes)), high,
                             _mm512_loadu_si512(planes + 128));
    if constexpr (kOnePlane) return hi;
    lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, low, _mm512_loadu_si512(planes + 64)), high,
                             _mm512_loadu_si512(planes + 192));
  } else {
    const __m512i biased = _mm512_xor_si512(codes, _mm512_set1_epi8(char(0x80)));
    hi = _mm512_dpbusd_epi32(zero, biased, _mm512_loadu_si512(planes));
    if constexpr (kOnePlane) return hi;
    lo = _mm512_dpbusd_epi32(zero, biased, _mm512_loadu_si512(planes + 64));
  }
  return _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
}

// y[m * w.n + n] for the M rows of x and output n. kOnePlane: the high planes' sums times
// kPlaneBase * scale * dx, the same floats as the full sums times scale * dx (a power of two
// moves between the factors exactly).
template <int M, bool kInt4, bool kOnePlane>
void OutputDotPlanes(const QuantWeights& w, const QuantizedX& x, int64_t n, float* y) {
  constexpr int64_t kRunsPerBlock = kInt4 ? 4 : 2, kRowBytes = kInt4 ? 16 : 32;
  const uint8_t* codes = static_cast<const uint8_t*>(w.packed) + n * (w.k / kRunInputs) * kRowBytes;
  const __m512i lane_run = _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             kInt4 ? 2 : 3);  // which run of the block a lane belongs to
  const int64_t runs = x.runs(), ahead = PrefetchAhead(w, n);
  if (ahead < w.n) PrefetchOutput(w, ahead);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t first = 0; first < runs; first += 16) {
    const int64_t count = std::min<int64_t>(16, runs - first);
    const __m512 scale = RunValues(w, w.scales, n, first, count);
    __m512 scale_dx[M], dot_scale[M];
    for (int m = 0; m < M; ++m) {
      scale_dx[m] = _mm512_mul_ps(scale, _mm512_loadu_ps(x.Dx(m) + first));
      dot_scale[m] = kOnePlane ? _mm512_mul_ps(scale_dx[m], _mm512_set1_ps(float(kPlaneBase))) : scale_dx[m];
      if constexpr (kInt4) {
        if (w.offsets != nullptr)
          acc[m] = _mm512_fmadd_ps(RunValues(w, w.offsets, n, first, count), _mm512_loadu_ps(x.Sum(m) + first), acc[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(scale_dx[m], _mm512_loadu_ps(x.Bias(m) + first), acc[m]);
      }
    }
    for (int64_t r = 0; r < count; r += kRunsPerBlock) {
      const int64_t block = (first + r) / kRunsPerBlock, bytes = std::min<int64_t>(64, (count - r) * kRowBytes);
      const uint8_t* at = codes + block * 64;
      const __m512i v = bytes == 64 ? _mm512_loadu_si512(at) : _mm512_maskz_loadu_epi8((__mmask64(1) << bytes) - 1, at);
      const __m512i lanes = _mm512_add_epi32(lane_run, _mm512_set1_epi32(int32_t(r)));
      for (int m = 0; m < M; ++m) {
        const __m512 dot = _mm512_cvtepi32_ps(BlockDot<kInt4, kOnePlane>(v, x.Planes(m, block)));
        acc[m] = _mm512_fmadd_ps(dot, _mm512_permutexvar_ps(lanes, dot_scale[m]), acc[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) y[m * w.n + n] = _mm512_reduce_add_ps(acc[m]);
}

template <int M, bool kInt4>
void OutputDot(const QuantWeights& w, const QuantizedX& x, int64_t n, float* y) {
  if (x.OnePlane()) OutputDotPlanes<M, kInt4, true>(w, x, n, y);
  else OutputDotPlanes<M, kInt4, false>(w, x, n, y);
}

#else  // JAXRUNNER_QUANT_DOT_AVX2

// A mask of the first `count` of 8 float lanes.
inline __m256 FirstLanes(int64_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(count)), lane));
}

// The weight scales (or offsets) of `count` (up to 8) runs from run `first` of output n, one per
// lane, zeros after them.
inline __m256 RunValues(const QuantWeights& w, const void* values, int64_t n, int64_t first, int64_t count) {
  const int64_t runs = w.k / kRunInputs, runs_per_group = runs / w.groups;
  if (runs_per_group == 1 && (count == 8 || n + 1 < w.n)) {  // one scale per run (GGUF blocks, int4 groups of 32)
    // Fewer than 8 runs left: the next output's values follow (only the last output's would lie
    // past the end), and the lanes after `count` are cleared.
    const int64_t at = n * w.groups + first;
    const __m256 all = w.half_scales
        ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + at)))
        : _mm256_loadu_ps(static_cast<const float*>(values) + at);
    return count == 8 ? all : _mm256_and_ps(all, FirstLanes(count));
  }
  if (w.groups == 1) return _mm256_and_ps(_mm256_set1_ps(w.ValueAt(values, n)), FirstLanes(count));  // per-channel int8
  alignas(32) float lanes[8] = {};
  for (int64_t j = 0; j < count; ++j) lanes[j] = w.ValueAt(values, n * w.groups + (first + j) / runs_per_group);
  return _mm256_load_ps(lanes);
}

// The int32 sums of two int4 runs' codes (32 bytes) with row m's matching words (the pair's 4
// vectors at `words`), four products per lane: lanes 0..3 the first run, 4..7 the second. The
// codes widen to 16 bits in place (a 16-bit lane holds inputs 2w and 2w + 1 in its low and high
// bytes' low nibbles, 16 + 2w and 17 + 2w in their high nibbles) and vpmaddwd multiplies them by
// x's words: exact, at most 4 * 2 * 15 * 32512 per lane.
inline __m256i PairDot(__m256i codes, const int16_t* words) {
  const __m256i nibble = _mm256_set1_epi16(15);
  const auto x = [words](int t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 16 * t)); };
  const __m256i a = _mm256_madd_epi16(_mm256_and_si256(codes, nibble), x(0));
  const __m256i b = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble), x(1));
  const __m256i c = _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi16(codes, 8), nibble), x(2));
  const __m256i d = _mm256_madd_epi16(_mm256_srli_epi16(codes, 12), x(3));
  return _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
}

// The int32 sums of one int8 run's codes (32 bytes) with row m's words (the even inputs at
// `words`, the odd ones 16 on), four products per lane, all lanes the one run: the codes widen
// to 16 bits with their signs by shifts.
inline __m256i RunDotInt8(__m256i codes, const int16_t* words) {
  const auto x = [words](int t) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 16 * t)); };
  const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(codes, 8), 8), odd = _mm256_srai_epi16(codes, 8);
  return _mm256_add_epi32(_mm256_madd_epi16(even, x(0)), _mm256_madd_epi16(odd, x(1)));
}

// Lane i: the sum of v[i]'s lanes, added in SumLanes' order, so that an output is the same float
// whether it was summed alone or among eight.
inline __m256 SumLanes8(const __m256 v[8]) {
  __m256 halves[4];  // j: lanes 0..3 hold v[2j]'s halves added, 4..7 v[2j + 1]'s, in the order 0, 2, 1, 3
  for (int j = 0; j < 4; ++j) {
    const __m256 a = v[2 * j], b = v[2 * j + 1];
    const __m256 h = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    halves[j] = _mm256_permute_ps(h, 0xD8);
  }
  // (h0 + h2) + (h1 + h3) per vector, in the lane order v[0], v[2], v[4], v[6], v[1], v[3], v[5], v[7]
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(halves[0], halves[1]), _mm256_hadd_ps(halves[2], halves[3]));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

inline float SumLanes(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// Row m's products with the codes of runs first .. first + count of one output, added into acc
// with each run's scale * dx (scale_dx, lane r for run first + r). int4: two runs per read, half
// of a block; int8: one run, half of a block too.
template <bool kInt4>
inline __m256 AddRuns(const uint8_t* codes, const QuantizedX& x, int m, int64_t first, int64_t count,
                      __m256 scale_dx, __m256 acc) {
  if constexpr (kInt4) {
    const __m256i lane_run = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // which run of the pair a lane belongs to
    for (int64_t r = 0; r < count; r += 2) {
      const int64_t run = first + r;
      const uint8_t* at = codes + run * 16;
      const __m256i v = count - r >= 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                       : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      const __m256 dot = _mm256_cvtepi32_ps(PairDot(v, x.Words(m, run / 4) + 64 * (run % 4 / 2)));
      const __m256i lanes = _mm256_add_epi32(lane_run, _mm256_set1_epi32(int32_t(r)));
      acc = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(scale_dx, lanes), acc);
    }
  } else {
    for (int64_t r = 0; r < count; ++r) {
      const int64_t run = first + r;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + run * 32));
      const __m256 dot = _mm256_cvtepi32_ps(RunDotInt8(v, x.Words(m, run / 2) + 32 * (run % 2)));
      acc = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(scale_dx, _mm256_set1_epi32(int32_t(r))), acc);
    }
  }
  return acc;
}

// How a chunk's scales (or offsets) are read: through RunValues, or, where every run has its own
// (GGUF blocks, int4 groups of 32), eight float16 or float32 values loaded whole.
enum class ChunkValues { kAny, kHalfPerRun, kFloatPerRun };

// Calls walk(form) with w's ChunkValues as a compile-time constant (a std::integral_constant).
template <typename Walk>
inline void WithChunkValues(const QuantWeights& w, Walk&& walk) {
  if (w.groups * kRunInputs != w.k) walk(std::integral_constant<ChunkValues, ChunkValues::kAny>());
  else if (w.half_scales) walk(std::integral_constant<ChunkValues, ChunkValues::kHalfPerRun>());
  else walk(std::integral_constant<ChunkValues, ChunkValues::kFloatPerRun>());
}

// RunValues with the values' form known: count (at most 8) runs from run `first` of output n.
template <ChunkValues kForm>
__attribute__((always_inline)) inline __m256 ChunkValuesOf(const QuantWeights& w, const void* values, int64_t n, int64_t first,
                                                           int64_t count) {
  if constexpr (kForm == ChunkValues::kAny) {
    return RunValues(w, values, n, first, count);
  } else {
    if (count < 8 && n + 1 == w.n) return RunValues(w, values, n, first, count);  // nothing after the last output's values
    const int64_t at = n * w.groups + first;
    const __m256 all = kForm == ChunkValues::kHalfPerRun
        ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(values) + at)))
        : _mm256_loadu_ps(static_cast<const float*>(values) + at);
    return count == 8 ? all : _mm256_and_ps(all, FirstLanes(count));
  }
}

// One chunk of OutputSums: runs first .. first + count (at most 8) of output n for the M rows from
// m0, added into acc.
template <int M, bool kInt4, ChunkValues kForm, typename X, typename AddRunsFn>
__attribute__((always_inline)) inline void AddChunk(const QuantWeights& w, const X& x, int64_t n, int64_t m0, const uint8_t* codes,
                                                    int64_t first, int64_t count, AddRunsFn& add_runs, __m256 acc[M]) {
  const __m256 scale = ChunkValuesOf<kForm>(w, w.scales, n, first, count);
  __m256 scale_dx[M];
  for (int m = 0; m < M; ++m) {
    if (kInt4 && w.offsets != nullptr)
      acc[m] = _mm256_fmadd_ps(ChunkValuesOf<kForm>(w, w.offsets, n, first, count), _mm256_loadu_ps(x.Sum(m0 + m) + first), acc[m]);
    scale_dx[m] = _mm256_mul_ps(scale, _mm256_loadu_ps(x.Dx(m0 + m) + first));
  }
  add_runs(codes, first, count, scale_dx, acc);
}

// The walk over output n that both forms of x share (this one's QuantizedX, quant_dot8.h's int8
// one): its runs in chunks of 8, each run's scale times x's dx for the M rows from m0, the int4
// offsets times x's sums, and add_runs(codes, first, count, scale_dx, acc) adding the codes'
// products into acc[m], whose lanes sum to the output of row m0 + m.
// The whole chunks run in a loop of their own, and the form of the scales is a template argument
// (WithChunkValues chooses it once per call): the one-row w4a8 walk then took about two thirds of
// the instructions per chunk, without a branch per pair on the count and per run on the form.
// The sums stay in a local array until the end: a store through an __m256 pointer may alias
// anything, and the walk reloaded x's and w's fields every chunk after one.
template <int M, bool kInt4, ChunkValues kForm, typename X, typename AddRunsFn>
__attribute__((always_inline)) inline void OutputSums(const QuantWeights& w, const X& x, int64_t n, int64_t m0, AddRunsFn& add_runs,
                                                      __m256 acc[M]) {
  constexpr int64_t kRowBytes = kInt4 ? 16 : 32;
  const uint8_t* codes = static_cast<const uint8_t*>(w.packed) + n * (w.k / kRunInputs) * kRowBytes;
  if constexpr (!kInt4) {  // int4 codes: see PrefetchOutput
    const int64_t ahead = PrefetchAhead(w, n);
    if (ahead < w.n) PrefetchOutput(w, ahead);
  }
  const int64_t runs = x.runs();
  __m256 sums[M];
  for (int m = 0; m < M; ++m) sums[m] = _mm256_setzero_ps();
  int64_t first = 0;
  for (; first + 8 <= runs; first += 8) AddChunk<M, kInt4, kForm>(w, x, n, m0, codes, first, 8, add_runs, sums);
  if (first < runs) AddChunk<M, kInt4, kForm>(w, x, n, m0, codes, first, runs - first, add_runs, sums);
  for (int m = 0; m < M; ++m) acc[m] = sums[m];
}

// y[(m0 + m) * w.n + n] for the M rows from m0: OutputSums, then each row's lanes summed.
template <int M, bool kInt4, typename X, typename AddRunsFn>
void OutputChunks(const QuantWeights& w, const X& x, int64_t n, float* y, int64_t m0, AddRunsFn add_runs) {
  WithChunkValues(w, [&](auto form) {
    __m256 acc[M];
    OutputSums<M, kInt4, decltype(form)::value>(w, x, n, m0, add_runs, acc);
    for (int m = 0; m < M; ++m) y[(m0 + m) * w.n + n] = SumLanes(acc[m]);
  });
}

// y[n0 .. n0 + 8) of a one-row x: eight outputs' sums reduced together and stored as one vector.
// Why: at 576 inputs an output is only 18 runs, and a horizontal sum and a scalar store of its
// own were a tenth of a batch-1 product's time on one core.
template <bool kInt4, typename X, typename AddRunsFn>
void EightOutputs(const QuantWeights& w, const X& x, int64_t n0, float* y, AddRunsFn add_runs) {
  WithChunkValues(w, [&](auto form) {
    __m256 acc[8];
    for (int o = 0; o < 8; ++o) OutputSums<1, kInt4, decltype(form)::value>(w, x, n0 + o, 0, add_runs, &acc[o]);
    _mm256_storeu_ps(y + n0, SumLanes8(acc));
  });
}

// add_runs for OutputChunks: the M rows' products by AddRuns.
template <int M, bool kInt4>
auto RowsAddRuns(const QuantizedX& x) {
  return [&x](const uint8_t* codes, int64_t first, int64_t count, const __m256* scale_dx, __m256* acc) {
    for (int m = 0; m < M; ++m) acc[m] = AddRuns<kInt4>(codes, x, m, first, count, scale_dx[m], acc[m]);
  };
}

// y[m * w.n + n] for the M rows of x and output n.
template <int M, bool kInt4>
void OutputDot(const QuantWeights& w, const QuantizedX& x, int64_t n, float* y) {
  OutputChunks<M, kInt4>(w, x, n, y, 0, RowsAddRuns<M, kInt4>(x));
}

// y[n0 .. n0 + 8) of a one-row x.
template <bool kInt4>
void EightOutputsDot(const QuantWeights& w, const QuantizedX& x, int64_t n0, float* y) {
  EightOutputs<kInt4>(w, x, n0, y, RowsAddRuns<1, kInt4>(x));
}

#endif

}  // namespace jaxrunner_cpu

#endif
