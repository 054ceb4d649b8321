// Weight-only products whose activations are rounded to int8 per run of 32 inputs: the "w4a8"
// quantization (jaxrunner/models/quant.py), for quant_matmul.cc.
//
// What it computes: each run of 32 inputs of x becomes q = round-to-nearest-even(x * (127 / peak))
// with dx = peak * (1 / 127), peak = max |x| over the run (GGUF's Q8_1, what llama.cpp multiplies its
// 4-bit weights with). models/quant.py rounds the same way in float32, so XLA's path and this one
// see the same integers; x already on that grid (RoundRunsToInt8Grid) rounds to the same integers
// again, which the 16-bit forms of quant_dot.h then multiply exactly (as 256 q).
//
// Why: with AVX2 alone, the codes' products with int8 x are vpmaddubsw (unsigned codes times signed
// bytes, pairs added into int16) and one vpmaddwd by ones: about two thirds of the instructions
// of the 16-bit form per 32 weights, and half the bytes of x read per weight. The 16-bit form is
// bound by instructions on CPUs that split 256-bit operations in halves (AMD Zen 1 and 2).
// int8 weights (the LM head of a 4-bit model) multiply as |w| times x carrying w's sign
// (vpsignb), which vpmaddubsw takes without overflow (2 * 128 * 127 < 32768).
//
// Layouts: an int4 run is 16 bytes (GGUF order: low nibbles are inputs 0..15, high nibbles
// 16..31), read two runs at a time; x's bytes for runs 2p and 2p + 1 are the 64 bytes [inputs 0..15
// of 2p, 0..15 of 2p + 1, 16..31 of 2p, 16..31 of 2p + 1], the order the nibbles come out in. An
// int8 run is 32 bytes, x in input order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_dot.h"
#include "vec.h"

namespace jaxrunner_cpu {

constexpr int64_t kInt8Run = 32;      // inputs per run that share one dx
constexpr float kInt8Max = 127.0f;    // the rounded inputs' largest magnitude
constexpr float kInt8Step = 1.0f / kInt8Max;  // dx per unit of peak (a product, as models/quant.py computes it)

// x [rows, k] (k a multiple of 32) replaced, run by run, by q * dx: the values the int8 form
// multiplies, for the paths that multiply floats. Every build, every row count.
inline void RoundRunsToInt8Grid(float* x, int64_t rows, int64_t k) {
  for (int64_t at = 0; at < rows * k; at += kInt8Run) {
    float peak = 0.0f;
    for (int64_t i = 0; i < kInt8Run; ++i) peak = std::max(peak, std::fabs(x[at + i]));
    const float inverse = peak > 0.0f ? kInt8Max / peak : 0.0f, dx = peak * kInt8Step;
    for (int64_t i = 0; i < kInt8Run; ++i) x[at + i] = std::nearbyint(x[at + i] * inverse) * dx;
  }
}

}  // namespace jaxrunner_cpu

#if JAXRUNNER_QUANT_DOT_AVX2
#define JAXRUNNER_QUANT_DOT8 1

namespace jaxrunner_cpu {

// x [rows, k] rounded to int8 per run, with per-run dx and sum(q) * dx (what int4 offsets multiply),
// padded with zeros to a multiple of 8 runs. The bytes lie in input order, or with nibble_order in
// the order int4 codes unpack in (see the top) for the per-output walk below.
class QuantizedX8 {
 public:
  QuantizedX8(const float* x, int64_t rows, int64_t k, bool nibble_order)
      : runs_(k / kInt8Run), padded_((runs_ + 7) / 8 * 8), nibble_order_(nibble_order), bytes_(rows * padded_ * kInt8Run, 0),
        dx_(rows * padded_, 0.0f), sum_(rows * padded_, 0.0f) {
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t r = 0; r < runs_; ++r) RoundRun(x + m * k + r * kInt8Run, m, r);
  }

  int64_t runs() const { return runs_; }
  const int8_t* Bytes(int64_t m) const { return bytes_.data() + m * padded_ * kInt8Run; }
  const float* Dx(int64_t m) const { return dx_.data() + m * padded_; }
  const float* Sum(int64_t m) const { return sum_.data() + m * padded_; }

 private:
  void RoundRun(const float* x, int64_t m, int64_t r) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 part[4], magnitude = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      part[i] = _mm256_loadu_ps(x + 8 * i);
      magnitude = _mm256_max_ps(magnitude, _mm256_andnot_ps(sign, part[i]));
    }
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(magnitude), _mm256_extractf128_ps(magnitude, 1));
    half = _mm_max_ps(half, _mm_shuffle_ps(half, half, 0x4E));
    const float peak = _mm_cvtss_f32(_mm_max_ps(half, _mm_shuffle_ps(half, half, 0xB1)));
    const __m256 inverse = _mm256_set1_ps(peak > 0.0f ? kInt8Max / peak : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(part[i], inverse));
    const __m256i lanes = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(lanes), _mm256_extracti128_si256(lanes, 1));
    sums = _mm_add_epi32(sums, _mm_shuffle_epi32(sums, 0x4E));
    const int32_t total = _mm_cvtsi128_si32(_mm_add_epi32(sums, _mm_shuffle_epi32(sums, 0xB1)));
    const int64_t slot = m * padded_ + r;
    dx_[slot] = peak * kInt8Step;
    sum_[slot] = float(total) * dx_[slot];
    // The 32 integers as bytes in input order (packs interleave 128-bit lanes; the permute undoes it)
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    int8_t* out = bytes_.data() + m * padded_ * kInt8Run;
    if (!nibble_order_) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * kInt8Run), bytes);
    } else {  // inputs 0..15 and 16..31 of run r where its codes' low and high nibbles meet them
      int8_t* at = out + (r / 2) * 64 + (r % 2) * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm256_castsi256_si128(bytes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(at + 32), _mm256_extracti128_si256(bytes, 1));
    }
  }

  int64_t runs_, padded_;
  bool nibble_order_;
  std::vector<int8_t> bytes_;     // [rows, padded runs * 32]
  std::vector<float> dx_, sum_;   // [rows, padded runs]
};

// Row m's int32 sums of one int8 run's 32 codes times x's bytes, eight lanes of four products.
inline __m256i RunDot8Int8(__m256i abs_codes, __m256i codes, const int8_t* x) {
  const __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)), codes);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_codes, xs), _mm256_set1_epi16(1));
}

// Four pairs of int4 runs' int16 sums (pair p: 8 lanes of run 2p, then 8 of run 2p + 1, each lane
// at most 4 * 15 * 127) as the 8 runs' int32 totals, in the lane order 0, 2, 4, 6, 1, 3, 5, 7.
// vphaddw twice (lanes of at most 16 * 15 * 127 < 32768) and one vpmaddwd instead of a conversion,
// a permute and an FMA per pair: a few percent faster over 48 runs, no slower over 18.
inline __m256i PairSums8(const __m256i sums[4]) {
  const __m256i runs_0246_1357 = _mm256_hadd_epi16(_mm256_hadd_epi16(sums[0], sums[1]), _mm256_hadd_epi16(sums[2], sums[3]));
  return _mm256_madd_epi16(runs_0246_1357, _mm256_set1_epi16(1));
}

// The M rows' (from m0) products with the codes of runs first .. first + count (at most 8) of one output,
// added into acc with each run's scale * dx (scale_dx, lane r for run first + r).
template <int M, bool kInt4>
inline void AddRuns8(const uint8_t* codes, const QuantizedX8& x, int64_t m0, int64_t first, int64_t count,
                     const __m256 scale_dx[M], __m256 acc[M]) {
  if constexpr (kInt4) {  // the 8 runs' sums summed across lanes into one vector (see PairSums8)
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // the runs of PairSums8's lanes
    const int64_t pairs = (count + 1) / 2;
    const auto unpack = [&](int64_t p, __m256i& lo, __m256i& hi) {  // pair p's codes, low and high nibbles
      const uint8_t* at = codes + (first + 2 * p) * 16;
      const __m256i v = count - 2 * p >= 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                           : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
      lo = _mm256_and_si256(v, nibble);
      hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    };
    const auto pair_sums = [](__m256i lo, __m256i hi, const int8_t* xs) {  // xs: the pair's 64 bytes of x
      return _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs))),
                              _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xs + 32))));
    };
    const auto add = [&](int m, const __m256i sums[4]) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(PairSums8(sums)), _mm256_permutevar8x32_ps(scale_dx[m], order), acc[m]);
    };
    // first is a multiple of 8: the chunk's pairs start at x.Bytes(row) + first * 32
    if constexpr (M == 1) {  // each pair multiplied as it is unpacked: a tenth faster alone than in two passes
      const int8_t* xs = x.Bytes(m0) + first * kInt8Run;
      __m256i sums[4], lo, hi;
      for (int64_t p = 0; p < 4; ++p) {
        if (p >= pairs) {
          sums[p] = _mm256_setzero_si256();
          continue;
        }
        unpack(p, lo, hi);
        sums[p] = pair_sums(lo, hi, xs + 64 * p);
      }
      add(0, sums);
    } else {  // the codes unpacked once for the M rows
      __m256i lo[4], hi[4];
      for (int64_t p = 0; p < pairs; ++p) unpack(p, lo[p], hi[p]);
      for (int m = 0; m < M; ++m) {
        const int8_t* xs = x.Bytes(m0 + m) + first * kInt8Run;
        __m256i sums[4];
        for (int64_t p = 0; p < 4; ++p) sums[p] = p < pairs ? pair_sums(lo[p], hi[p], xs + 64 * p) : _mm256_setzero_si256();
        add(m, sums);
      }
    }
  } else {
    for (int64_t r = 0; r < count; ++r) {
      const int64_t run = first + r;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + run * 32));
      const __m256i magnitude = _mm256_abs_epi8(v), lane = _mm256_set1_epi32(int32_t(r));
      for (int m = 0; m < M; ++m) {
        const __m256 dot = _mm256_cvtepi32_ps(RunDot8Int8(magnitude, v, x.Bytes(m0 + m) + run * kInt8Run));
        acc[m] = _mm256_fmadd_ps(dot, _mm256_permutevar8x32_ps(scale_dx[m], lane), acc[m]);
      }
    }
  }
}

// add_runs for OutputChunks: the M rows' (from m0) products by AddRuns8.
template <int M, bool kInt4>
auto RowsAddRuns8(const QuantizedX8& x, int64_t m0) {
  return [&x, m0](const uint8_t* codes, int64_t first, int64_t count, const __m256* scale_dx, __m256* acc) {
    AddRuns8<M, kInt4>(codes, x, m0, first, count, scale_dx, acc);
  };
}

// y[(m0 + m) * w.n + n] for the M rows of x from m0 and output n.
template <int M, bool kInt4>
void OutputDot8(const QuantWeights& w, const QuantizedX8& x, int64_t n, float* y, int64_t m0 = 0) {
  OutputChunks<M, kInt4>(w, x, n, y, m0, RowsAddRuns8<M, kInt4>(x, m0));
}

// y[n0 .. n0 + 8) of a one-row x.
template <bool kInt4>
void EightOutputsDot8(const QuantWeights& w, const QuantizedX8& x, int64_t n0, float* y) {
  EightOutputs<kInt4>(w, x, n0, y, RowsAddRuns8<1, kInt4>(x, 0));
}

// y[:, n] for every row of x: blocks of four rows, each reading output n's codes again (from cache).
template <bool kInt4>
void OutputDot8AllRows(const QuantWeights& w, const QuantizedX8& x, int64_t rows, int64_t n, float* y) {
  int64_t m0 = 0;
  for (; m0 + 4 <= rows; m0 += 4) OutputDot8<4, kInt4>(w, x, n, y, m0);
  switch (rows - m0) {
    case 3: OutputDot8<3, kInt4>(w, x, n, y, m0); break;
    case 2: OutputDot8<2, kInt4>(w, x, n, y, m0); break;
    case 1: OutputDot8<1, kInt4>(w, x, n, y, m0); break;
    default: break;
  }
}

}  // namespace jaxrunner_cpu

#endif
