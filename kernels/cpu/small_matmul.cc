// Matmul with few rows for XLA:CPU, as an XLA FFI custom call: y [M, N] float32 = x [M, K] . W,
// for 1 <= M <= 4, x and W both bfloat16 or both float32, with W either [K, N] (a projection) or
// [N, K] (the tied embedding used as the LM head).
//
// Why: a batch-1 decode reads every weight once per token, so it is bound by memory bandwidth
// (SmolLM2: 269 MB in bf16, 538 MB in float32). XLA:CPU's one-row bf16 dot is a GEMV 9x slower than
// four rows, and padded to four rows it still read weights at ~9 GB/s: a bf16 token cost as much
// as a float32 one, which reads twice the bytes. Its float32 GEMV reads ~34 GB/s on the largest
// projection but less on the narrow ones (16-26 GB/s), ~19 GB/s over a whole float32 token. Here
// each weight is read once, in contiguous blocks, on two or more threads, with software prefetch into L2.
// Measured (2-core EPYC, 30 distinct weights per run, min of 20): bf16 one row x [576, 3072]
// 398 -> 220 us per call, tied LM head [1, 576] x [49152, 576]^T 4.1 -> 2.7 ms (2.2-2.5 ms once
// its rows were prefetched into L2: four 57 MB tables, 3.3-5.1 ms before); float32 [576, 576]
// 84 -> 61 us, [1536, 576] 137 -> 105, [576, 3072] 209 -> 212, LM head 5.0 -> 4.2 ms. With four
// rows this kernel was no faster than XLA, so the model routes only one-row products here
// (jaxrunner/models/linear.py).
//
// Products of two bf16 values are exact in float32 and sums are float32, as in XLA's
// bf16 x bf16 -> f32 dot; only the order of the additions differs (float32 likewise).
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "helper_thread.h"
#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr int kMaxRows = 4;
constexpr int64_t kRowsPerItem = 256;  // [N, K]: outputs of one work item
// [K, N]: weight rows prefetched ahead. The hardware prefetcher alone left narrow weights slow
// (min per call, three rounds): [1, 576] x [576, 576] 50-62 -> 33-40 us, x [576, 960] 86-103 -> 67-70.
constexpr int64_t kPrefetchRows = 16;
constexpr int64_t kNkPrefetchBytes = 16 << 10;  // [N, K]: bytes ahead of the rows being read
// [N, K] float32 weights of this many inputs or more are left to the hardware prefetcher, which
// streamed them faster alone (one row, 1B-model layer weights [N, 2048] and [2048, 8192]: 17.5-21
// GB/s with the software prefetch, 20-25 without), while bf16 ones of 2048 inputs read faster with
// it (12-13.5 -> 15-16.7 GB/s) and SmolLM2's head rows (576 inputs) were tuned with it.
constexpr int64_t kNkUnprefetchedFloat32K = 1024;

struct Problem {
  int64_t rows, k, n;
  const float* x;       // [rows, k] the activations in float32 (converted once per call if bf16)
  const void* x_given;  // [rows, k] the activations as given (the weights' dtype)
  const void* w;        // [k, n] or [n, k], WT: uint16_t (bf16 bits) or float
  float* y;             // [rows, n]; [splits, rows, n] partial sums for [K, N] weights
  int64_t splits;       // [K, N] weights: work items, each a block of K rows
  bool transposed;      // W is [N, K]
};

// A product shares its items with the one HelperThread, which the next product of a decode step
// finds awake: waking one of XLA's pool threads for each product took about as long as a small
// product (a bf16 one-row [576, 3072] product in a SmolLM2 step ran at 2-4x its time alone), and
// on two cores the pool adds no core the helper does not (the tied LM head, 56-113 MB, also ran
// faster on the helper there). Only a product of several megabytes on a pool of more threads
// spreads over XLA's threads, where they add cores to stream the weights with.
constexpr int64_t kPooledBytes = int64_t(8) << 20;  // weight bytes from which a larger pool joins

// ---- W [K, N]: item s owns rows [k0, k1) of W -- one contiguous block of memory, which the
// hardware prefetcher streams -- and writes its partial sums to y[s] (the caller adds the
// partials; XLA fuses that sum into what follows). Four weight rows at a time: each
// float32 accumulator (in L1/L2) takes four FMAs per load and store; rows kPrefetchRows ahead are
// prefetched.

template <int M, typename WT>
void RowsKN(const Problem& p, int64_t k0, int64_t k1, float* y) {
  const WT* w = static_cast<const WT*>(p.w);
  constexpr int64_t kChunksPerLine = 64 / (kLanes * sizeof(WT));  // 2 for bf16, 1 for float32
  std::fill(y, y + M * p.n, 0.0f);
  const int64_t chunks = p.n / kLanes;
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const WT* r = w + k * p.n;
    F16 xv[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) xv[m][j] = Splat(p.x[m * p.k + k + j]);
    const bool prefetch = k + 4 + kPrefetchRows <= k1;
    for (int64_t c = 0; c < chunks; ++c) {
      if (prefetch && c % kChunksPerLine == 0) {  // one line per row per 64 bytes read
        const WT* ahead = r + kPrefetchRows * p.n + c * kLanes;
        for (int j = 0; j < 4; ++j) PrefetchLine(reinterpret_cast<const char*>(ahead + j * p.n));
      }
      const F16 w0 = Load(r + c * kLanes), w1 = Load(r + p.n + c * kLanes);
      const F16 w2 = Load(r + 2 * p.n + c * kLanes), w3 = Load(r + 3 * p.n + c * kLanes);
      for (int m = 0; m < M; ++m) {
        F16 a;
        std::memcpy(&a, y + m * p.n + c * kLanes, sizeof a);
        a += xv[m][0] * w0 + xv[m][1] * w1 + xv[m][2] * w2 + xv[m][3] * w3;
        std::memcpy(y + m * p.n + c * kLanes, &a, sizeof a);
      }
    }
  }
  for (; k < k1; ++k)  // the last rows when the block is not a multiple of 4
    for (int64_t c = 0; c < chunks; ++c) {
      const F16 wv = Load(w + k * p.n + c * kLanes);
      for (int m = 0; m < M; ++m) {
        F16 a;
        std::memcpy(&a, y + m * p.n + c * kLanes, sizeof a);
        a += Splat(p.x[m * p.k + k]) * wv;
        std::memcpy(y + m * p.n + c * kLanes, &a, sizeof a);
      }
    }
}

template <int M, typename WT>
void ItemKN(const Problem& p, int64_t item) {
  const int64_t k0 = p.k * item / p.splits, k1 = p.k * (item + 1) / p.splits;
  RowsKN<M, WT>(p, k0, k1, p.y + item * M * p.n);
}

// ---- W [N, K]: output n is the dot product of x's rows with W's row n, both contiguous in K.
// Four outputs at a time share each x load, 64 bytes of each row per step; bf16 pairs of K
// elements go through one AVX512-BF16 dot-product instruction where the CPU has it.

inline F16 Dot64Bytes(F16 acc, const float* a, const float* b) { return acc + Load(a) * Load(b); }

inline F16 Dot64Bytes(F16 acc, const uint16_t* a, const uint16_t* b) {  // a[0:32] . b[0:32], paired
#if defined(__AVX512BF16__)
  __m512bh av, bv;
  std::memcpy(&av, a, sizeof av);
  std::memcpy(&bv, b, sizeof bv);
  __m512 r = _mm512_dpbf16_ps(reinterpret_cast<__m512&>(acc), av, bv);
  return reinterpret_cast<F16&>(r);
#else
  return acc + Load(a) * Load(b) + Load(a + kLanes) * Load(b + kLanes);
#endif
}

template <int M, typename WT>
void OutputsNK(const Problem& p, int64_t n0, int64_t count) {  // count <= 4 outputs
  constexpr int64_t step = 64 / sizeof(WT);  // K elements per 64 bytes
  const WT* w = static_cast<const WT*>(p.w);
  const WT* x = static_cast<const WT*>(p.x_given);
  F16 acc[M][4] = {};
  const WT* rows[4];
  for (int j = 0; j < 4; ++j) rows[j] = w + (n0 + std::min<int64_t>(j, count - 1)) * p.k;
  // The four rows are one contiguous block; the block kNkPrefetchBytes further on is prefetched,
  // four lines per step, so the prefetches keep pace with the reads.
  const char* ahead = reinterpret_cast<const char*>(rows[0]) + kNkPrefetchBytes;
  const char* end = reinterpret_cast<const char*>(w + p.n * p.k);
  const bool prefetch = !(std::is_same_v<WT, float> && p.k >= kNkUnprefetchedFloat32K);
  for (int64_t k = 0; k < p.k; k += step, ahead += 4 * 64) {
    for (int l = 0; l < 4 && prefetch; ++l)
      if (ahead + 64 * l < end) PrefetchLine(ahead + 64 * l);
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = Dot64Bytes(acc[m][j], x + m * p.k + k, rows[j] + k);
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < count; ++j) p.y[m * p.n + n0 + j] = Sum(acc[m][j]);
}

template <int M, typename WT>
void ItemNK(const Problem& p, int64_t item) {
  const int64_t n0 = item * kRowsPerItem, n1 = std::min(p.n, n0 + kRowsPerItem);
  for (int64_t n = n0; n < n1; n += 4) OutputsNK<M, WT>(p, n, std::min<int64_t>(4, n1 - n));
}

struct NoScratch {};

template <int M, typename WT>
void Item(const void* problem, int64_t item) {
  const Problem& p = *static_cast<const Problem*>(problem);
  if (p.transposed) ItemNK<M, WT>(p, item);
  else ItemKN<M, WT>(p, item);
}

template <int M, typename WT>
void Run(ffi::ThreadPool& pool, const Problem& p) {
  const int64_t items = p.transposed ? (p.n + kRowsPerItem - 1) / kRowsPerItem : p.splits;
  if (p.k * p.n * int64_t(sizeof(WT)) < kPooledBytes || pool.num_threads() <= kHelperThreads)
    return HelperThread::Run(Item<M, WT>, &p, items);
  RunItems<NoScratch>(pool, items, [p](int64_t i, NoScratch&) { Item<M, WT>(&p, i); });
}

template <typename WT>
void RunRows(ffi::ThreadPool& pool, const Problem& p) {
  switch (p.rows) {
    case 1: Run<1, WT>(pool, p); break;
    case 2: Run<2, WT>(pool, p); break;
    case 3: Run<3, WT>(pool, p); break;
    default: Run<4, WT>(pool, p); break;
  }
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                       ffi::Result<ffi::AnyBuffer> y, int64_t transposed) {
  using ffi::DataType;
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const bool bf16 = x.element_type() == DataType::BF16;
  if ((!bf16 && x.element_type() != DataType::F32) || w.element_type() != x.element_type() ||
      y->element_type() != DataType::F32)
    return ffi::Error::InvalidArgument("small matmul: x and w must be both bfloat16 or both float32, y float32");
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != (transposed ? 2 : 3))
    return ffi::Error::InvalidArgument("small matmul: x and w must be matrices, y [M, N] or [splits, M, N]");
  const int64_t rows = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  const int64_t splits = transposed ? 1 : yd[0];
  if ((transposed ? wd[1] : wd[0]) != k || yd[yd.size() - 2] != rows || yd[yd.size() - 1] != n ||
      splits < 1 || splits > k)
    return ffi::Error::InvalidArgument("small matmul: shapes do not match");
  if (rows < 1 || rows > kMaxRows)
    return ffi::Error::InvalidArgument("small matmul: x must have 1 to 4 rows");
  if (transposed ? k % (64 / (bf16 ? 2 : 4)) != 0 : n % kLanes != 0)
    return ffi::Error::InvalidArgument("small matmul: K must fill whole 64-byte vectors ([N, K] weights: "
                                       "32 bf16 or 16 float32), N a multiple of 16 ([K, N] weights)");
  std::vector<float> x32;
  const float* xf = static_cast<const float*>(x.untyped_data());
  if (bf16) {
    const uint16_t* x16 = static_cast<const uint16_t*>(x.untyped_data());
    x32.resize(rows * k);
    for (int64_t i = 0; i < rows * k; ++i) x32[i] = ToF32(x16[i]);
    xf = x32.data();
  }
  const Problem p{rows, k, n, xf, x.untyped_data(), w.untyped_data(), static_cast<float*>(y->untyped_data()), splits,
                  transposed != 0};
  if (bf16) RunRows<uint16_t>(pool, p);
  else RunRows<float>(pool, p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuSmallMatmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16 or f32
                                  .Arg<ffi::AnyBuffer>()  // w [K, N] or [N, K], x's dtype
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32; [splits, M, N] for [K, N] w
                                  .Attr<int64_t>("transposed"));
