// Weight-only quantized matmul with few rows for XLA:CPU, as an XLA FFI custom call:
// y [M, N] float32 = x [M, K] . W^T, any M >= 1, x float32 or bfloat16, W [N, K] quantized as
// jaxrunner/models/quant.py describes: int8 (`packed` int8 [N, K]) or int4 (`packed` uint8
// [N, K/2], two inputs per byte in GGUF's Q4_0 order), with `scales` [N, G] and, for int4,
// `offsets` [N, G], both float32 or both float16 (a GGUF's own block scales):
// w[n, k] = scales[n, g] * q[n, k] + offsets[n, g], g = k / (K / G).
//
// Why: a batch-1 decode reads every weight once per token, so its time is the bytes it reads.
// Here the packed bytes are read once, in the order they lie in memory, and unpacked to float32
// in registers; nothing the size of the float weight is ever written. Per group, the codes'
// products with x accumulate in float32 and are scaled once; the offsets contribute
// offset * sum(x over the group), with the sums computed once per call. With AVX-512, int4
// instead looks each code up in its group's sixteen weight values (OutputInt4). With AVX512-VNNI,
// products of up to kMaxRows rows are integer dot products on x rounded to 16 bits per run of 32
// inputs instead (quant_dot.h): about half the vector instructions per weight; with AVX2 alone,
// the same through vpmaddwd. With AVX512-VNNI, more rows multiply the same integers as a GEMM
// over panels of sixteen outputs (quant_gemm_vnni.h); with AVX2 alone, float32 panels
// (quant_gemm_f32.h); elsewhere, tiles of four outputs by four rows (TileItem).
//
// With x_int8 (the "w4a8" quantization), x is first rounded to int8 per run of 32 inputs, as
// models/quant.py rounds it for XLA's path; with AVX2 alone, the rows then multiply as int8: int4
// weights' through the panel GEMM from kMinGemmRows rows (quant_gemm8.h), the rest up to
// kMaxInt8Rows through the per-output walk (quant_dot8.h). Every other form takes x on that grid.
//
// Portable: GCC/Clang vector extensions compiled with -march=native (kernels/native.py), so the
// same source becomes AVX-512, AVX2 or SSE code for the CPU it is built on.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "helper_thread.h"
#include "quant_dot.h"
#include "quant_dot8.h"
#include "quant_gemm8.h"
#include "quant_gemm_f32.h"
#include "quant_gemm_vnni.h"
#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr int kMaxRows = 4;  // rows of the streaming path; more go through the panel GEMMs or TileItem
// Rows the int8 dot products take (x_int8, quant_dot8.h), four at a time: all that
// models/linear.py sends here without the panel GEMMs (NATIVE_QUANT_ROWS). With them, int8 codes
// of more rows take the float32 panel GEMM on x's int8 grid.
constexpr int kMaxInt8Rows = 16;
// int4 weights with x_int8 from this many rows, any number of them: the panel GEMM
// (quant_gemm8.h), which linear.py then sends every row count (MatmulKernels.weight_only_gemm). Its
// packing costs more than it saves at up to three rows, where quant_dot8.h's walk stays.
constexpr int64_t kMinGemmRows = 4;
constexpr int64_t kGemmOutputs = 16;  // outputs per work item: two panels
constexpr int64_t kRun = 32;           // inputs per run: 16 bytes of int4, 32 of int8
constexpr int64_t kOutputsPerItem = 32;

typedef uint8_t B16 __attribute__((vector_size(16)));

// 16 bytes (0..255) -> 16 floats. Spelled out per instruction set: GCC 12 turned the generic
// __builtin_convertvector of 16 bytes into per-element scalar conversions, and on AVX2 into half
// scalar code, which made the kernel compute-bound.
inline F16 Widen(B16 b) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i&>(b)));
  return reinterpret_cast<const F16&>(f);
#elif defined(__AVX2__)
  const __m128i v = reinterpret_cast<__m128i&>(b);
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  F16 out;
  std::memcpy(&out, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&out) + sizeof lo, &hi, sizeof hi);
  return out;
#else
  return __builtin_convertvector(__builtin_convertvector(b, I16), F16);
#endif
}

struct Problem {
  int64_t rows, k, n, groups;
  const float* x;        // [rows, k] float32
  const float* xsum;     // [rows, groups] sum of x over each group
  const void* packed;    // [n, k/2] uint8 or [n, k] int8
  const void* scales;    // [n, groups] float32, or float16 with half_scales
  const void* offsets;   // [n, groups] like scales, or null
  float* y;              // [rows, n]
  bool half_scales;
#if JAXRUNNER_QUANT_DOT
  const QuantizedX* qx = nullptr;  // x for the integer dot products (few rows), or null
#if JAXRUNNER_QUANT_DOT8
  const QuantizedX8* qx8 = nullptr;  // x rounded to int8 for them (x_int8), or null
  const QuantizedX8* gemm_x = nullptr;  // x rounded to int8 in input order for the panel GEMM, or null
#endif
  QuantWeights Weights(bool int4) const { return {packed, scales, offsets, half_scales, int4, n, k, groups}; }
#endif

  float Scale(int64_t i) const { return ScaleAt(scales, i); }
  float Offset(int64_t i) const { return offsets == nullptr ? 0.0f : ScaleAt(offsets, i); }
  float ScaleAt(const void* base, int64_t i) const {
    return half_scales ? HalfToF32(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
  }
};

// The 32 weights of one run as two 16-float vectors (inputs 0..15 and 16..31).
inline void Unpack(const uint8_t* p, F16& lo, F16& hi) {  // int4: low nibbles, then high
  B16 b;
  std::memcpy(&b, p, sizeof b);
  lo = Widen(b & 15);
  hi = Widen(b >> 4);
}
inline void Unpack(const int8_t* p, F16& lo, F16& hi) {  // int8: q = (q ^ 0x80) - 128, widened unsigned
  B16 a, b;
  std::memcpy(&a, p, sizeof a);
  std::memcpy(&b, p + 16, sizeof b);
  lo = Widen(a ^ 0x80) - Splat(128.0f);
  hi = Widen(b ^ 0x80) - Splat(128.0f);
}

#if defined(__AVX512F__)
// int4 with AVX-512: the sixteen values a group's codes stand for (scale * q + offset, q = 0..15)
// fill one register, and a permute looks up sixteen codes at once, which are already in the low
// four bits of each 32-bit lane (vpermps reads no others). Per 32 weights: one widening load, one
// shift, two permutes and two FMAs with x; the form that converted codes to float and scaled
// per group read about two thirds as many bytes per second on one core, the table form about
// what the memory delivers.
inline __m512 GroupTable(const Problem& p, int64_t n, int64_t g) {
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t i = n * p.groups + g;
  return _mm512_fmadd_ps(codes, _mm512_set1_ps(p.Scale(i)), _mm512_set1_ps(p.Offset(i)));
}

// The 32 weights of one int4 run (16 bytes at p), looked up in a group's table.
inline void LookUp(const uint8_t* p, __m512 table, __m512& lo, __m512& hi) {
  const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_permutexvar_ps(codes, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
}

template <int M>
void OutputInt4(const Problem& p, int64_t n) {
  const uint8_t* row = static_cast<const uint8_t*>(p.packed) + n * (p.k / 2);
  const int64_t runs_per_group = p.k / p.groups / kRun;
  __m512 acc_lo[M], acc_hi[M];
  for (int m = 0; m < M; ++m) acc_lo[m] = acc_hi[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    const __m512 table = GroupTable(p, n, g);
    for (int64_t r = 0; r < runs_per_group; ++r, k += kRun, row += 16) {
      __m512 lo, hi;
      LookUp(row, table, lo, hi);
      for (int m = 0; m < M; ++m) {
        acc_lo[m] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(p.x + m * p.k + k), acc_lo[m]);
        acc_hi[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(p.x + m * p.k + k + 16), acc_hi[m]);
      }
    }
  }
  for (int m = 0; m < M; ++m) p.y[m * p.n + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc_lo[m], acc_hi[m]));
}

inline void DequantizeRowInt4(const Problem& p, int64_t n, float* out) {
  const uint8_t* row = static_cast<const uint8_t*>(p.packed) + n * (p.k / 2);
  const int64_t runs_per_group = p.k / p.groups / kRun;
  for (int64_t g = 0, k = 0; g < p.groups; ++g) {
    const __m512 table = GroupTable(p, n, g);
    for (int64_t r = 0; r < runs_per_group; ++r, k += kRun, row += 16) {
      __m512 lo, hi;
      LookUp(row, table, lo, hi);
      _mm512_storeu_ps(out + k, lo);
      _mm512_storeu_ps(out + k + 16, hi);
    }
  }
}
#elif defined(__AVX2__)
// AVX2 without AVX-512: the same float form as the portable Output below, in 256-bit registers,
// about a fifth faster than the portable form (whose vectors are pairs of halves on AVX2, vec.h).
template <typename QT>
inline void Unpack8(const QT* run, __m256 w[4]) {  // the 32 weights of one run, 8 per register
  if constexpr (std::is_same<QT, uint8_t>::value) {  // int4: low nibbles are 0..15, high 16..31
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run)), nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(bytes, nibble), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16));
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  }
}

inline float Sum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

template <int M, typename QT>
void OutputAvx2(const Problem& p, int64_t n) {
  constexpr int64_t kRunBytes = std::is_same<QT, uint8_t>::value ? 16 : 32;
  const QT* row = static_cast<const QT*>(p.packed) + n * (p.k / kRun) * kRunBytes;
  const int64_t runs_per_group = p.k / p.groups / kRun;
  __m256 acc[M];
  float off[M] = {};
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0, k = 0; g < p.groups; ++g) {
    __m256 part[M];
    for (int m = 0; m < M; ++m) part[m] = _mm256_setzero_ps();
    for (int64_t r = 0; r < runs_per_group; ++r, k += kRun, row += kRunBytes) {
      __m256 w[4];
      Unpack8(row, w);
      for (int m = 0; m < M; ++m)
        for (int j = 0; j < 4; ++j) part[m] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(p.x + m * p.k + k + 8 * j), part[m]);
    }
    const __m256 s = _mm256_set1_ps(p.Scale(n * p.groups + g));
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(part[m], s, acc[m]);
    if (p.offsets != nullptr)
      for (int m = 0; m < M; ++m) off[m] += p.Offset(n * p.groups + g) * p.xsum[m * p.groups + g];
  }
  for (int m = 0; m < M; ++m) p.y[m * p.n + n] = Sum8(acc[m]) + off[m];
}
#endif

template <int M, typename QT>
void Output(const Problem& p, int64_t n) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<QT, uint8_t>::value) return OutputInt4<M>(p, n);
#elif defined(__AVX2__)
  return OutputAvx2<M, QT>(p, n);
#endif
  constexpr int64_t kRunBytes = std::is_same<QT, uint8_t>::value ? 16 : 32;  // bytes per run
  const QT* row = static_cast<const QT*>(p.packed) + n * (p.k / kRun) * kRunBytes;
  const int64_t runs_per_group = p.k / p.groups / kRun;
  F16 acc[M] = {};
  float off[M] = {};
  int64_t k = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    F16 part[M] = {};
    for (int64_t r = 0; r < runs_per_group; ++r, k += kRun, row += kRunBytes) {
      F16 lo, hi;
      Unpack(row, lo, hi);
      for (int m = 0; m < M; ++m) part[m] += lo * Load(p.x + m * p.k + k) + hi * Load(p.x + m * p.k + k + 16);
    }
    const F16 s = Splat(p.Scale(n * p.groups + g));
    for (int m = 0; m < M; ++m) acc[m] += part[m] * s;
    if (p.offsets != nullptr)
      for (int m = 0; m < M; ++m) off[m] += p.Offset(n * p.groups + g) * p.xsum[m * p.groups + g];
  }
  for (int m = 0; m < M; ++m) p.y[m * p.n + n] = Sum(acc[m]) + off[m];
}

struct NoScratch {};

// ---- Many rows (a prefill chunk): four outputs at a time, their weights unpacked once into a
// float32 scratch [4, K] (L1/L2), then every block of four x rows against them: sixteen
// accumulators, eight loads per sixteen FMAs. Each packed byte is still read once per call.

template <typename QT>
void DequantizeRow(const Problem& p, int64_t n, float* out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same<QT, uint8_t>::value) return DequantizeRowInt4(p, n, out);
#endif
  constexpr int64_t kRunBytes = std::is_same<QT, uint8_t>::value ? 16 : 32;
  const QT* row = static_cast<const QT*>(p.packed) + n * (p.k / kRun) * kRunBytes;
  const int64_t runs_per_group = p.k / p.groups / kRun;
  for (int64_t g = 0, k = 0; g < p.groups; ++g) {
    const F16 s = Splat(p.Scale(n * p.groups + g));
    const F16 o = Splat(p.Offset(n * p.groups + g));
    for (int64_t r = 0; r < runs_per_group; ++r, k += kRun, row += kRunBytes) {
      F16 lo, hi;
      Unpack(row, lo, hi);
      lo = lo * s + o;
      hi = hi * s + o;
      std::memcpy(out + k, &lo, sizeof lo);
      std::memcpy(out + k + 16, &hi, sizeof hi);
    }
  }
}

struct TileScratch {
  std::vector<float> w;  // [4, K] the current four outputs' weights
};

template <typename QT>
void TileItem(const Problem& p, int64_t item, TileScratch& scratch) {
  scratch.w.resize(4 * p.k);
  float* w = scratch.w.data();
  const int64_t n1 = std::min(p.n, (item + 1) * kOutputsPerItem);
  for (int64_t n0 = item * kOutputsPerItem; n0 < n1; n0 += 4) {
    const int64_t count = std::min<int64_t>(4, n1 - n0);
    for (int64_t j = 0; j < 4; ++j) DequantizeRow<QT>(p, n0 + std::min(j, count - 1), w + j * p.k);
    for (int64_t m0 = 0; m0 < p.rows; m0 += 4) {
      const int64_t mc = std::min<int64_t>(4, p.rows - m0);
      const float* x[4];
      for (int64_t i = 0; i < 4; ++i) x[i] = p.x + (m0 + std::min(i, mc - 1)) * p.k;
      F16 acc[4][4] = {};
      for (int64_t k = 0; k < p.k; k += kLanes) {
        const F16 w0 = Load(w + k), w1 = Load(w + p.k + k), w2 = Load(w + 2 * p.k + k), w3 = Load(w + 3 * p.k + k);
        for (int i = 0; i < 4; ++i) {
          const F16 xv = Load(x[i] + k);
          acc[i][0] += xv * w0;
          acc[i][1] += xv * w1;
          acc[i][2] += xv * w2;
          acc[i][3] += xv * w3;
        }
      }
      for (int64_t i = 0; i < mc; ++i) {
        const F4 sums = Sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        for (int64_t j = 0; j < count; ++j) p.y[(m0 + i) * p.n + n0 + j] = sums[j];
      }
    }
  }
}

template <typename QT>
void RunTiles(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t items = (p.n + kOutputsPerItem - 1) / kOutputsPerItem;
  RunItems<TileScratch>(pool, items, [p](int64_t item, TileScratch& scratch) { TileItem<QT>(p, item, scratch); });
}

// Few rows: a product under a few megabytes shares its outputs with the one HelperThread, which
// a decode step's next product finds awake (a batch-1 int4 step ran about a tenth faster than on
// the calling thread alone). A helper from XLA's pool takes about as long to wake as such a
// product takes in all (with those, the step was slower than on one thread). A product of
// several megabytes, such as a tied LM head, spreads over XLA's threads where they are more than
// the helper's two: on two cores the pool adds no core, and the caller with both pool threads
// oversubscribed them (docs/performance.md has the int8 LM head's rates both ways).
constexpr int64_t kPooledBytes = int64_t(4) << 20;  // packed bytes from which a larger pool joins

template <int M, typename QT>
void OutputsItem(const void* problem, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(problem);
  const int64_t n1 = std::min(p.n, (item + 1) * kOutputsPerItem);
#if JAXRUNNER_QUANT_DOT
  constexpr bool kInt4 = std::is_same<QT, uint8_t>::value;
#if JAXRUNNER_QUANT_DOT8
  if (p.qx8 != nullptr) {
    const QuantWeights w = p.Weights(kInt4);
    int64_t n = item * kOutputsPerItem;
    if (p.rows == 1)
      for (; n + 8 <= n1; n += 8) EightOutputsDot8<kInt4>(w, *p.qx8, n, p.y);
    for (; n < n1; ++n) OutputDot8AllRows<kInt4>(w, *p.qx8, p.rows, n, p.y);
    return;
  }
#endif
  if (p.qx != nullptr) {
    const QuantWeights w = p.Weights(kInt4);
    int64_t n = item * kOutputsPerItem;
#if JAXRUNNER_QUANT_DOT_AVX2
    if constexpr (M == 1)
      for (; n + 8 <= n1; n += 8) EightOutputsDot<kInt4>(w, *p.qx, n, p.y);
#endif
    for (; n < n1; ++n) OutputDot<M, kInt4>(w, *p.qx, n, p.y);
    return;
  }
#endif
  for (int64_t n = item * kOutputsPerItem; n < n1; ++n) Output<M, QT>(p, n);
}

template <int M, typename QT>
void Run(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t row_bytes = std::is_same<QT, uint8_t>::value ? p.k / 2 : p.k;
  const int64_t items = (p.n + kOutputsPerItem - 1) / kOutputsPerItem;
  if (p.n * row_bytes < kPooledBytes || pool.num_threads() <= kHelperThreads)
    return HelperThread::Run(OutputsItem<M, QT>, &p, items);
  RunItems<NoScratch>(pool, items, [p](int64_t item, NoScratch&) { OutputsItem<M, QT>(&p, item); });
}

#if JAXRUNNER_QUANT_GEMM8 || JAXRUNNER_VNNI_GEMM
#define JAXRUNNER_PANEL_GEMM 1
// Sixteen outputs for every row. AVX2: int4 codes times x rounded to int8 (gemm_x), or float32
// panels; AVX512-VNNI: the codes times x's 16-bit integers (qx, every row count).
template <typename QT>
void GemmItem(const void* problem, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(problem);
  constexpr bool kInt4 = std::is_same<QT, uint8_t>::value;
  const int64_t n0 = item * kGemmOutputs, count = std::min(kGemmOutputs, p.n - n0);
#if JAXRUNNER_QUANT_GEMM8
  if (p.gemm_x != nullptr) return PanelProduct(p.Weights(kInt4), *p.gemm_x, p.rows, n0, count, p.y);
  FloatPanelProduct<kInt4>(p.Weights(kInt4), p.x, p.rows, n0, count, p.y);
#else
  static_assert(kVnniPanelOutputs == kGemmOutputs, "a work item is one panel");
  VnniPanelProduct<kInt4>(p.Weights(kInt4), *p.qx, p.rows, n0, count, p.y);
#endif
}

// On the helper's two threads unless XLA's pool has more and the product is large (the pool's
// threads take about as long to wake as a small product takes).
template <typename QT>
void RunGemm(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t items = (p.n + kGemmOutputs - 1) / kGemmOutputs;
  const int64_t packed_bytes = std::is_same<QT, uint8_t>::value ? p.n * p.k / 2 : p.n * p.k;
  if (pool.num_threads() <= kHelperThreads || (p.rows <= kMaxInt8Rows && packed_bytes < kPooledBytes))
    return HelperThread::Run(GemmItem<QT>, &p, items);
  RunItems<NoScratch>(pool, items, [p](int64_t item, NoScratch&) { GemmItem<QT>(&p, item); });
}
#endif

template <typename QT>
void RunRows(ffi::ThreadPool& pool, const Problem& p) {
#if JAXRUNNER_QUANT_DOT8
  if (p.qx8 != nullptr) return Run<1, QT>(pool, p);  // M unused: OutputsItem walks every row
#endif
#if JAXRUNNER_QUANT_GEMM8
  if (p.gemm_x != nullptr) return RunGemm<QT>(pool, p);
#endif
#if JAXRUNNER_PANEL_GEMM
  if (p.rows > kMaxRows) return RunGemm<QT>(pool, p);
#endif
  if (p.rows > kMaxRows) return RunTiles<QT>(pool, p);
  switch (p.rows) {
    case 1: Run<1, QT>(pool, p); break;
    case 2: Run<2, QT>(pool, p); break;
    case 3: Run<3, QT>(pool, p); break;
    default: Run<4, QT>(pool, p); break;
  }
}

bool ScalesTyped(const ffi::AnyBuffer& scales, const ffi::AnyBuffer& offsets) {
  const auto type = scales.element_type();
  return (type == ffi::DataType::F32 || type == ffi::DataType::F16) && offsets.element_type() == type;
}

ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::AnyBuffer scales,
                       ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> y, int64_t has_offsets, int64_t x_int8) {
  using ffi::DataType;
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  const bool bf16 = x.element_type() == DataType::BF16;
  const bool int4 = packed.element_type() == DataType::U8;
  if ((!bf16 && x.element_type() != DataType::F32) || (!int4 && packed.element_type() != DataType::S8) ||
      !ScalesTyped(scales, offsets) || y->element_type() != DataType::F32)
    return ffi::Error::InvalidArgument("quantized matmul: x bf16 or f32, packed uint8 or int8, scales and offsets "
                                       "both f32 or both f16, y f32");
  if (xd.size() != 2 || pd.size() != 2 || sd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("quantized matmul: all operands must be matrices");
  const int64_t rows = xd[0], k = xd[1], n = pd[0], groups = sd[1];
  if (pd[1] * (int4 ? 2 : 1) != k || sd[0] != n || yd[0] != rows || yd[1] != n || groups < 1 ||
      k % groups != 0 || (k / groups) % kRun != 0)
    return ffi::Error::InvalidArgument("quantized matmul: shapes do not match, or groups are not whole runs of 32");
  if (has_offsets && (offsets.dimensions().size() != 2 || offsets.dimensions()[0] != n ||
                      offsets.dimensions()[1] != groups))
    return ffi::Error::InvalidArgument("quantized matmul: offsets must be [N, G] like scales");
  if (rows < 1) return ffi::Error::InvalidArgument("quantized matmul: x must have at least one row");
  if (x_int8 && k % kInt8Run != 0)
    return ffi::Error::InvalidArgument("quantized matmul: x_int8 needs K to be whole runs of 32");
  std::vector<float> x32(rows * k), xsum(rows * groups, 0.0f);
  if (bf16) {
    const uint16_t* x16 = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t i = 0; i < rows * k; ++i) x32[i] = ToF32(x16[i]);
  } else {
    std::memcpy(x32.data(), x.untyped_data(), rows * k * sizeof(float));
  }
  Problem p{rows, k, n, groups, x32.data(), xsum.data(), packed.untyped_data(),
            scales.untyped_data(), has_offsets ? offsets.untyped_data() : nullptr,
            static_cast<float*>(y->untyped_data()), scales.element_type() == DataType::F16};
#if JAXRUNNER_QUANT_DOT8
  std::unique_ptr<QuantizedX8> qx8;  // keeps its own sums of x, per run
#if JAXRUNNER_QUANT_GEMM8
  if (x_int8 && int4 && rows >= kMinGemmRows)
    p.gemm_x = (qx8 = std::make_unique<QuantizedX8>(x32.data(), rows, k, false)).get();
#endif
  if (x_int8 && !qx8 && rows <= kMaxInt8Rows) p.qx8 = (qx8 = std::make_unique<QuantizedX8>(x32.data(), rows, k, int4)).get();
  const bool int8_dot = qx8 != nullptr;
#else
  const bool int8_dot = false;
#endif
  if (x_int8 && !int8_dot) RoundRunsToInt8Grid(x32.data(), rows, k);  // the float forms take x on its int8 grid
  bool group_sums = rows <= kMaxRows && !int8_dot;  // the streaming path's offsets multiply x's group sums
#if JAXRUNNER_QUANT_DOT
  std::unique_ptr<QuantizedX> qx;  // keeps its own sums of x, per run
#if JAXRUNNER_VNNI_GEMM
  const bool integer_rows = !int8_dot;  // every row count: the VNNI panels take more than the streaming path
#else
  const bool integer_rows = group_sums;
#endif
  if (integer_rows) p.qx = (qx = std::make_unique<QuantizedX>(x32.data(), rows, k, int4)).get();
  group_sums = group_sums && p.qx == nullptr;
#endif
  if (group_sums) {
    const int64_t group = k / groups;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t i = 0; i < k; ++i) xsum[m * groups + i / group] += x32[m * k + i];
  }
  if (int4) RunRows<uint8_t>(pool, p);
  else RunRows<int8_t>(pool, p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuQuantMatmul, QuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16 or f32
                                  .Arg<ffi::AnyBuffer>()  // packed [N, K/2] uint8 or [N, K] int8
                                  .Arg<ffi::AnyBuffer>()  // scales [N, G] f32 or f16
                                  .Arg<ffi::AnyBuffer>()  // offsets [N, G] like scales (ignored without has_offsets)
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32
                                  .Attr<int64_t>("has_offsets")
                                  .Attr<int64_t>("x_int8"));  // x rounded to int8 per run of 32 first (quant_dot8.h)

// ---- Dequantize a whole weight into float32 [N, K], for products too big for the kernel above
// (long prefill chunks), which XLA's dot then takes: the same unpacking as DequantizeRow, on all
// threads, in place of an XLA fusion that unpacked nibbles several times slower.
namespace {

ffi::Error Dequantize(ffi::ThreadPool pool, ffi::AnyBuffer /*after*/, ffi::AnyBuffer packed, ffi::AnyBuffer scales, ffi::AnyBuffer offsets,
                      ffi::Result<ffi::AnyBuffer> w, int64_t has_offsets) {
  using ffi::DataType;
  const bool int4 = packed.element_type() == DataType::U8;
  const auto pd = packed.dimensions(), sd = scales.dimensions(), wd = w->dimensions();
  if ((!int4 && packed.element_type() != DataType::S8) || !ScalesTyped(scales, offsets) ||
      w->element_type() != DataType::F32)
    return ffi::Error::InvalidArgument("dequantize: packed uint8 or int8, scales and offsets both f32 or both f16, "
                                       "w f32");
  if (pd.size() != 2 || sd.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("dequantize: all operands must be matrices");
  const int64_t n = pd[0], k = pd[1] * (int4 ? 2 : 1), groups = sd[1];
  if (sd[0] != n || wd[0] != n || wd[1] != k || groups < 1 || k % groups != 0 || (k / groups) % kRun != 0)
    return ffi::Error::InvalidArgument("dequantize: shapes do not match, or groups are not whole runs of 32");
  if (has_offsets && (offsets.dimensions().size() != 2 || offsets.dimensions()[0] != n ||
                      offsets.dimensions()[1] != groups))
    return ffi::Error::InvalidArgument("dequantize: offsets must be [N, G] like scales");
  const Problem p{0, k, n, groups, nullptr, nullptr, packed.untyped_data(),
                  scales.untyped_data(), has_offsets ? offsets.untyped_data() : nullptr, nullptr,
                  scales.element_type() == DataType::F16};
  float* out = static_cast<float*>(w->untyped_data());
  const int64_t items = (n + kOutputsPerItem - 1) / kOutputsPerItem;
  RunItems<NoScratch>(pool, items, [p, out, int4](int64_t item, NoScratch&) {
    const int64_t n1 = std::min(p.n, (item + 1) * kOutputsPerItem);
    for (int64_t row = item * kOutputsPerItem; row < n1; ++row) {
      if (int4) DequantizeRow<uint8_t>(p, row, out + row * p.k);
      else DequantizeRow<int8_t>(p, row, out + row * p.k);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuDequantize, Dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // after: not read (orders the call)
                                  .Arg<ffi::AnyBuffer>()  // packed [N, K/2] uint8 or [N, K] int8
                                  .Arg<ffi::AnyBuffer>()  // scales [N, G] f32 or f16
                                  .Arg<ffi::AnyBuffer>()  // offsets [N, G] like scales (ignored without has_offsets)
                                  .Ret<ffi::AnyBuffer>()  // w [N, K] f32
                                  .Attr<int64_t>("has_offsets"));

// Whether this build has the panel GEMMs (quant_gemm_vnni.h, or quant_gemm8.h and quant_gemm_f32.h),
// which take products of every row count: kernels/native.py asks once, and models/linear.py routes
// products by it.
extern "C" int JaxrunnerCpuPanelGemm() {
#if JAXRUNNER_PANEL_GEMM
  return 1;
#else
  return 0;
#endif
}
