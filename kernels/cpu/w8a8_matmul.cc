// "w8a8" products on AMX-INT8 tiles for XLA:CPU, as an XLA FFI custom call: y [M, N] = x [M, K]
// rounded to int8 per row, times int8 weights, int32 sums, scaled back -- one call where XLA ran
// half a dozen small fusions around its int8 dot (the rounding of x to int8 and its scales before,
// the conversion and the two scales after), 240 of them in a decode step of SmolLM2.
//
// Semantics: the formula of models/linear.py's w8a8_matmul, exactly in IEEE float32: per row of x
// (bf16 or float32, read as float32), scale = max(max|x| / 127, min_scale) and q =
// round-half-even(x / scale) as int8; acc = q . W_q exactly in int32; y = (float(acc) * scale_x) *
// scale_w, rounded to x's dtype. (XLA's own vectorised division rounds some scales an ulp apart.)
//
// Layout of the weight (kernels/w8a8_tiles.py): W_q [K, N] as AMX B tiles, [N/16, K/64, 16, 16, 4]
// int8 -- block b of 16 outputs, step s of 64 inputs; entry [b, s, i, j, e] is W_q[64s + 4i + e,
// 16b + j] (AMX's VNNI form: four consecutive inputs of one output side by side), zero-padded to
// whole tiles. Each tile is 1 KB of consecutive memory, in the order the product reads them. The
// rounded x is an A operand (16 rows by 64 inputs, rows K apart); a block's 16 outputs for up to
// 64 rows are four accumulator tiles C_g [16 rows][16 outputs], stored as y's rows are laid out.
//
// Threads: items of kBlocksPerItem blocks. Up to 16 rows (decoding a few sequences) they are
// shared with the native kernels' helper thread (helper_thread.h), which a step's next product
// finds awake (batch-1 decoding ran markedly faster so than through XLA's pool). More rows go to
// XLA's pool: beside the helper, which stays awake a while after each call and so shares the
// cores with XLA's threads, the products of a 64-sequence decode step ran slower end to end than
// XLA's own int8 path, and through the pool faster (docs/performance.md, "CPU model 207"). Each
// thread configures its tiles per item and releases them after it. AMX
// needs the kernel's permission per process (arch_prctl), asked once; builds without AMX-INT8
// report the kernel unavailable and the runner keeps XLA's path.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "helper_thread.h"
#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define JAXRUNNER_AMX_INT8 1
#include "amx.h"
#else
#define JAXRUNNER_AMX_INT8 0
#endif

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr int64_t kTileRows = 16;      // rows of x per group; outputs per block
constexpr int64_t kTileK = 64;         // inputs per step (int8)
constexpr int64_t kTileBytes = 1024;
constexpr int64_t kGroupsPerPass = 4;  // accumulator tiles: 64 rows of x per pass over a block
constexpr int64_t kBlocksPerItem = 4;  // 64 outputs per item shared with the helper thread

#if JAXRUNNER_AMX_INT8

bool AmxReady() { return AmxGranted(); }

template <typename XT>
struct Problem {
  int64_t m, n;
  int64_t steps, groups, blocks;  // K / 64, M / 16, N / 16, rounded up
  int64_t row_bytes;              // of the rounded x: steps * 64
  const int8_t* xq;               // [groups * 16, row_bytes]
  const float* x_scale;           // [m]
  const int8_t* tiles;            // [blocks, steps, 16, 16, 4]
  const float* w_scale;           // [n]
  XT* y;                          // [m, n]
};

inline __mmask16 Lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
}

// 16 lanes of x as float32 from `count` values (zeros past them), widened as vec.h's Load widens.
template <typename XT>
inline __m512 LoadLanes(const XT* p, int64_t count) {
  if (count >= kLanes) return (__m512)Load(p);
  alignas(64) XT tail[kLanes] = {};
  std::memcpy(tail, p, count * sizeof(XT));
  return (__m512)Load(tail);
}

// The first `count` of 16 lanes stored in y's dtype, rounded as vec.h's Store rounds.
template <typename XT>
inline void StoreLanes(__m512 v, XT* p, int64_t count) {
  if (count >= kLanes) return Store((F16)v, p);
  alignas(64) XT tail[kLanes];
  Store((F16)v, tail);
  std::memcpy(p, tail, count * sizeof(XT));
}

// Rows of x rounded to int8 (zeros past m and k), and their scales, as quant.quantize_activations:
// max|x| / 127 (at least min_scale), then x / scale rounded half to even (IEEE division, exact as
// numpy's float32 one). A row holding a NaN gets a NaN scale, so its outputs are NaN, as XLA's
// maximum propagates it.
template <typename XT>
void RoundRows(const XT* x, int64_t m, int64_t k, int64_t rows, int64_t row_bytes, float min_scale,
               int8_t* xq, float* scale) {
  std::memset(xq, 0, rows * row_bytes);
  for (int64_t r = 0; r < m; ++r) {
    const XT* src = x + r * k;
    __m512 largest = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 v = LoadLanes(src + i, k - i);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(v));
    }
    const float s = nan ? std::numeric_limits<float>::quiet_NaN()
                        : std::max(_mm512_reduce_max_ps(largest) / 127.0f, min_scale);
    scale[r] = s;
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 v = _mm512_div_ps(LoadLanes(src + i, k - i), sv);
      const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_mask_storeu_epi8(xq + r * row_bytes + i, Lanes(k - i), _mm512_cvtsepi32_epi8(q));
    }
  }
}

template <int G, typename XT>
void BlockPass(const Problem<XT>& p, int64_t b, int64_t g0) {
  _tile_zero(0);
  if (G > 1) _tile_zero(1);
  if (G > 2) _tile_zero(2);
  if (G > 3) _tile_zero(3);
  const int8_t* w = p.tiles + b * p.steps * kTileBytes;
  const int8_t* x = p.xq + g0 * kTileRows * p.row_bytes;
  const int64_t stride = kTileRows * p.row_bytes;
  for (int64_t s = 0; s < p.steps; ++s) {
    _tile_loadd(4, w + s * kTileBytes, 64);
    _tile_loadd(5, x + s * kTileK, p.row_bytes);
    _tile_dpbssd(0, 5, 4);
    if (G > 1) {
      _tile_loadd(6, x + stride + s * kTileK, p.row_bytes);
      _tile_dpbssd(1, 6, 4);
    }
    if (G > 2) {
      _tile_loadd(7, x + 2 * stride + s * kTileK, p.row_bytes);
      _tile_dpbssd(2, 7, 4);
    }
    if (G > 3) {
      _tile_loadd(5, x + 3 * stride + s * kTileK, p.row_bytes);
      _tile_dpbssd(3, 5, 4);
    }
  }
  alignas(64) int32_t c[kGroupsPerPass][kTileRows * kTileRows];  // [g][row][output]
  _tile_stored(0, c[0], 64);
  if (G > 1) _tile_stored(1, c[1], 64);
  if (G > 2) _tile_stored(2, c[2], 64);
  if (G > 3) _tile_stored(3, c[3], 64);
  const int64_t n0 = b * kTileRows, outputs = p.n - n0;
  const __m512 w_scale = LoadLanes(p.w_scale + n0, outputs);
  for (int g = 0; g < G; ++g) {
    const int64_t rows = std::min<int64_t>(kTileRows, p.m - (g0 + g) * kTileRows);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = (g0 + g) * kTileRows + i;
      const __m512 acc = _mm512_cvtepi32_ps(_mm512_load_si512(c[g] + i * kTileRows));
      StoreLanes(_mm512_mul_ps(_mm512_mul_ps(acc, _mm512_set1_ps(p.x_scale[row])), w_scale), p.y + row * p.n + n0, outputs);
    }
  }
}

template <typename XT>
void Item(const void* problem, int64_t item) {
  const Problem<XT>& p = *static_cast<const Problem<XT>*>(problem);
  const int64_t b1 = std::min(p.blocks, (item + 1) * kBlocksPerItem);
  ConfigureTiles();
  for (int64_t b = item * kBlocksPerItem; b < b1; ++b)
    for (int64_t g0 = 0; g0 < p.groups; g0 += kGroupsPerPass) {
      switch (std::min<int64_t>(kGroupsPerPass, p.groups - g0)) {
        case 1: BlockPass<1>(p, b, g0); break;
        case 2: BlockPass<2>(p, b, g0); break;
        case 3: BlockPass<3>(p, b, g0); break;
        default: BlockPass<4>(p, b, g0); break;
      }
    }
  _tile_release();
}

struct NoScratch {};

template <typename XT>
void Run(ffi::ThreadPool& pool, const void* x, int64_t m, int64_t k, int64_t n, int64_t steps, int64_t blocks, float min_scale,
         const int8_t* tiles, const float* w_scale, void* y) {
  const int64_t groups = (m + kTileRows - 1) / kTileRows, row_bytes = steps * kTileK;
  thread_local std::vector<int8_t> xq;  // reused: a step makes a hundred such calls
  thread_local std::vector<float> x_scale;
  xq.resize(groups * kTileRows * row_bytes);
  x_scale.resize(m);
  RoundRows(static_cast<const XT*>(x), m, k, groups * kTileRows, row_bytes, min_scale, xq.data(), x_scale.data());
  const Problem<XT> p{m, n, steps, groups, blocks, row_bytes, xq.data(), x_scale.data(), tiles, w_scale,
                      static_cast<XT*>(y)};
  const int64_t items = (blocks + kBlocksPerItem - 1) / kBlocksPerItem;
  if (groups == 1) return HelperThread::Run(Item<XT>, &p, items);
  RunItems<NoScratch>(pool, items, [&p](int64_t i, NoScratch&) { Item<XT>(&p, i); });
}

ffi::Error W8a8Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> w_scale,
                      ffi::Result<ffi::AnyBuffer> y, float min_scale) {
  using ffi::DataType;
  if (!AmxReady()) return ffi::Error::Internal("w8a8 matmul: the kernel did not grant AMX to this process");
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const bool bf16 = x.element_type() == DataType::BF16;
  if ((!bf16 && x.element_type() != DataType::F32) || y->element_type() != x.element_type() ||
      w.element_type() != DataType::S8)
    return ffi::Error::InvalidArgument("w8a8 matmul: x bf16 or float32, w int8, y x's dtype");
  if (xd.size() != 2 || wd.size() != 5 || yd.size() != 2 || wd[2] != 16 || wd[3] != 16 || wd[4] != 4)
    return ffi::Error::InvalidArgument("w8a8 matmul: x [M, K], w [N/16, K/64, 16, 16, 4], y [M, N]");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  const int64_t steps = (k + kTileK - 1) / kTileK, blocks = (n + kTileRows - 1) / kTileRows;
  if (yd[0] != m || wd[0] != blocks || wd[1] != steps || w_scale.dimensions()[0] != n || m < 1)
    return ffi::Error::InvalidArgument("w8a8 matmul: shapes do not match");
  const int8_t* tiles = static_cast<const int8_t*>(w.untyped_data());
  if (bf16) Run<uint16_t>(pool, x.untyped_data(), m, k, n, steps, blocks, min_scale, tiles, w_scale.typed_data(), y->untyped_data());
  else Run<float>(pool, x.untyped_data(), m, k, n, steps, blocks, min_scale, tiles, w_scale.typed_data(), y->untyped_data());
  return ffi::Error::Success();
}

#else  // built without AMX-INT8

bool AmxReady() { return false; }

ffi::Error W8a8Matmul(ffi::ThreadPool, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Buffer<ffi::F32>, ffi::Result<ffi::AnyBuffer>, float) {
  return ffi::Error::Internal("w8a8 matmul: this build of the native kernels has no AMX-INT8");
}

#endif

}  // namespace

// 1 where this build has the AMX-INT8 matmul and the kernel grants AMX to the process (for ctypes).
extern "C" int JaxrunnerCpuW8a8MatmulReady() { return AmxReady() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuW8a8Matmul, W8a8Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()        // x [M, K] bf16 or f32
                                  .Arg<ffi::AnyBuffer>()        // w [N/16, K/64, 16, 16, 4] int8 tiles
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w_scale [N]
                                  .Ret<ffi::AnyBuffer>()        // y [M, N], x's dtype
                                  .Attr<float>("min_scale"));
