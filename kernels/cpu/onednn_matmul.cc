// Matmul through oneDNN for XLA:CPU, as XLA FFI custom calls: y [M, N] float32 = x [M, K] . W, on
// weights packed once into oneDNN's blocked layout (x and W both bfloat16 or both float32), and on
// weight-only int4/int8 weights as they are or laid out as panels, a tile of columns unpacked at a
// time (x bfloat16; see the section below and dequantize_tile.h).
//
// Why: XLA:CPU's bf16 dot leaves AMX unused; oneDNN's brgemm kernels use it (the library torch and
// vLLM's CPU build call). Two things decide how fast they run inside an XLA step:
//   * The layout of W. From a plain row-major W, oneDNN repacks the weight into AMX's VNNI blocks
//     on every call; packed once at load (JaxrunnerCpuOnednnPack), a call reads the blocks as they
//     are: 1.3-1.7x the plain layout's speed on SmolLM2's and a 1B Llama's projections at 8-64 rows.
//   * The threads. oneDNN's own OpenMP team and XLA's thread pool hand the cores back and forth:
//     inside a step, two OpenMP threads ran no faster than one. Here W is packed as two halves of
//     its columns (whole 64-column blocks), and two threads each run one half on oneDNN with a
//     single thread: the caller and one of XLA's pool threads, or for products of a few rows the
//     native kernels' persistent helper (helper_thread.h; see RunHalves). brgemm takes no
//     row stride for its output (a strided one fell to oneDNN's reference kernel), so a half is
//     computed into the thread's own buffer and copied into its columns while still in cache:
//     returned as two results instead, XLA did not fuse their concatenation into what followed
//     and copied them once more (a SmolLM2 decode step of 64 rows spent 5-7 % of its time there).
// Which products come here is decided by the model (jaxrunner/models/packed_weights.py, and
// models/linear.py for weight-only ones) from the choice made at start-up
// (jaxrunner/kernels/platform_support.py, a table of where it was measured).
//
// Packed bytes: the halves one after the other, each starting at a multiple of 64 bytes, each in
// the layout oneDNN chooses for a product of kPackRows rows (the same for every row count on the
// CPUs measured; a primitive that cannot take it fails at warm-up, which runs every row count).
// JaxrunnerOnednnPackedBytes (plain C, for ctypes) gives the size before anything is traced.
//
// One primitive per (M, K, N, half, dtype), created on its first call -- during warm-up, which runs
// every bucketed shape -- and kept for the life of the process: creating one costs far more than
// running it. Products of two bf16 values are exact in float32 and oneDNN accumulates in float32,
// as XLA's bf16 x bf16 -> f32 dot does; only the order of the additions differs (float32 likewise).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "dequantize_tile.h"
#include "helper_thread.h"
#include "work_queue.h"
#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using dt = dnnl::memory::data_type;
using tag = dnnl::memory::format_tag;

constexpr int64_t kPackRows = 64;   // rows of the product the packed layout is chosen for
constexpr int64_t kColumnBlock = 64;  // halves split at whole blocks of this many columns
constexpr int64_t kAlign = 64;        // bytes: where each half starts

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dt DataType(bool bf16) { return bf16 ? dt::bf16 : dt::f32; }

// oneDNN on this thread alone while it lives, then as before. oneDNN plans a primitive's work for
// the threads OpenMP offers when the primitive is created and asks for that many when it runs, so
// both happen inside one of these: a primitive planned for two threads started two OpenMP threads
// per half, four on two cores.
class SingleThreaded {
 public:
  SingleThreaded() : before_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SingleThreaded() { omp_set_num_threads(before_); }

 private:
  int before_;
};

// Columns of the first of two halves: whole blocks of kColumnBlock; all of them under two blocks.
int64_t FirstHalfWidth(int64_t n) {
  const int64_t blocks = (n + kColumnBlock - 1) / kColumnBlock;
  return blocks >= 2 ? (blocks + 1) / 2 * kColumnBlock : n;
}

struct Half {
  int64_t n0, n, offset;      // columns [n0, n0 + n); byte offset in the packed weight
  dnnl::memory::desc packed;  // its blocked layout
};

struct Layout {
  std::vector<Half> halves;  // one when N is under two blocks
  int64_t bytes = 0;
};

// The packed layout of a [K, N] weight, decided once per shape and dtype.
const Layout& PackedLayout(int64_t k, int64_t n, bool bf16) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, bool>, std::unique_ptr<Layout>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_tuple(k, n, bf16);
  auto found = cache.find(key);
  if (found != cache.end()) return *found->second;
  auto layout = std::make_unique<Layout>();
  SingleThreaded single;  // the layout chosen for the primitives that will read it
  const int64_t first = FirstHalfWidth(n);
  for (int64_t n0 = 0; n0 < n;) {
    const int64_t width = std::min(first, n - n0);
    dnnl::matmul::primitive_desc pd(Engine(), dnnl::memory::desc({kPackRows, k}, DataType(bf16), tag::ab),
                                    dnnl::memory::desc({k, width}, DataType(bf16), tag::any),
                                    dnnl::memory::desc({kPackRows, width}, dt::f32, tag::ab));
    layout->halves.push_back({n0, width, layout->bytes, pd.weights_desc()});
    layout->bytes += (int64_t(pd.weights_desc().get_size()) + kAlign - 1) / kAlign * kAlign;
    n0 += width;
  }
  return *cache.emplace(key, std::move(layout)).first->second;
}

struct Primitive {
  dnnl::memory::desc x, w, y;
  dnnl::matmul matmul;
  size_t scratch_bytes;
};

// The matmul of made.x, made.w and made.y, with a scratchpad the caller brings.
void Finish(Primitive& made) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::matmul::primitive_desc pd(Engine(), made.x, made.w, made.y, attr);
  made.scratch_bytes = pd.scratchpad_desc().get_size();
  made.matmul = dnnl::matmul(pd);
}

// Runs `primitive` on this thread: y = x . w, with this thread's stream and scratchpad.
void Execute(const Primitive& primitive, const void* x, const void* w, float* y) {
  thread_local dnnl::stream stream(Engine());
  thread_local std::vector<uint8_t> scratch;
  if (scratch.size() < primitive.scratch_bytes) scratch.resize(primitive.scratch_bytes);
  dnnl::memory xm(primitive.x, Engine(), const_cast<void*>(x));
  dnnl::memory wm(primitive.w, Engine(), const_cast<void*>(w));
  dnnl::memory ym(primitive.y, Engine(), y);
  dnnl::memory sm(dnnl::memory::desc({int64_t(primitive.scratch_bytes)}, dt::u8, tag::a), Engine(), scratch.data());
  primitive.matmul.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}, {DNNL_ARG_SCRATCHPAD, sm}});
  stream.wait();
}

// Copies y_part [m, width] into columns [n0, n0 + width) of y [m, n].
void PlaceColumns(const float* part, float* y, int64_t m, int64_t n, int64_t n0, int64_t width) {
  for (int64_t r = 0; r < m; ++r) std::memcpy(y + r * n + n0, part + r * width, width * sizeof(float));
}

// The primitive for one half at one row count, created once. A primitive is immutable after
// creation and oneDNN allows executing it from several threads at once (each brings its own
// scratchpad here), so a reference to it outlives the lock.
const Primitive& PrimitiveFor(int64_t m, int64_t k, const Half& half, bool bf16) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, bool>, std::unique_ptr<Primitive>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_tuple(m, k, half.n0, half.n, bf16);
  auto found = cache.find(key);
  if (found != cache.end()) return *found->second;
  auto made = std::make_unique<Primitive>();
  made->x = dnnl::memory::desc({m, k}, DataType(bf16), tag::ab);
  made->y = dnnl::memory::desc({m, half.n}, dt::f32, tag::ab);  // contiguous: brgemm refuses a strided one
  made->w = half.packed;
  Finish(*made);
  return *cache.emplace(key, std::move(made)).first->second;
}

struct Call {
  const void* x;
  const uint8_t* w;
  float* y;  // [m, n]
  int64_t m, k, n;
  bool bf16;
  const Layout* layout;
};

// Products of this many rows or more run their halves on XLA's intra-op pool; fewer, on the
// native kernels' helper thread. The helper, awake (yielding) for a while after each call, wins
// where a step is a chain of products that read their weights once (batch-1 decoding), and loses
// where products take turns with the attention and element-wise work on XLA's threads: on two
// cores it then contends with them. The measurements behind the threshold are in
// docs/performance.md ("CPU matmuls").
constexpr int64_t kPoolRows = 8;

void RunHalves(ffi::ThreadPool& pool, int64_t rows, jaxrunner_cpu::HelperThread::Task task, const void* context,
               int64_t halves) {
  if (rows >= kPoolRows)
    jaxrunner_cpu::RunItems<int>(pool, halves, [task, context](int64_t i, int&) { task(context, i); });
  else
    jaxrunner_cpu::HelperThread::Run(task, context, halves);
}

// Half `index` of a product, on the calling thread alone.
void RunHalf(const void* context, int64_t index) {
  const Call& call = *static_cast<const Call*>(context);
  const Half& half = call.layout->halves[index];
  SingleThreaded single;  // the other half has the other core
  const Primitive& primitive = PrimitiveFor(call.m, call.k, half, call.bf16);
  thread_local std::vector<float> out;
  const bool whole = half.n == call.n;
  if (!whole && out.size() < size_t(call.m * half.n)) out.resize(call.m * half.n);
  Execute(primitive, call.x, call.w + half.offset, whole ? call.y : out.data());
  if (!whole) PlaceColumns(out.data(), call.y, call.m, call.n, half.n0, half.n);
}

// PackedLayout(k, n, bf16).bytes, or -1 when oneDNN has no matmul for the shape.
int64_t PackedBytes(int64_t k, int64_t n, bool bf16) {
  try {
    return PackedLayout(k, n, bf16).bytes;
  } catch (const dnnl::error&) {
    return -1;
  }
}

bool IsBf16(ffi::DataType type) { return type == ffi::DataType::BF16; }
bool IsFloat(ffi::DataType type) { return type == ffi::DataType::BF16 || type == ffi::DataType::F32; }

ffi::Error PackedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                        int64_t n) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || !IsFloat(x.element_type()) || w.element_type() != ffi::DataType::U8 ||
      w.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("onednn packed matmul: x [M, K] bf16 or float32, w packed bytes");
  const bool bf16 = IsBf16(x.element_type());
  if (PackedBytes(xd[1], n, bf16) != int64_t(w.dimensions()[0]))
    return ffi::Error::InvalidArgument("onednn packed matmul: w was packed for another K, N or dtype");
  try {
    const Layout& layout = PackedLayout(xd[1], n, bf16);
    const Call call{x.untyped_data(), static_cast<const uint8_t*>(w.untyped_data()),
                    static_cast<float*>(y->untyped_data()), xd[0], xd[1], n, bf16, &layout};
    RunHalves(pool, xd[0], RunHalf, &call, int64_t(layout.halves.size()));
  } catch (const dnnl::error& err) {
    return ffi::Error::Internal(std::string("onednn packed matmul: ") + err.what());
  }
  return ffi::Error::Success();
}

// ---- Weight-only int4/int8 weights (models/quant.py's leaves, as they are) times bf16 x: each
// half of the columns on one core, as above, a tile of columns at a time. A tile is unpacked into
// bf16 in the blocked layout the AMX kernels read (dequantize_tile.h) and multiplied while it is
// still in cache, so the weights are read from memory as the int4/int8 bytes they are: the
// bf16 weight is never whole in memory, as it is when XLA dequantizes before its dot.

constexpr int64_t kTileBudget = 512 << 10;  // bytes of one bf16 tile: it and x stay in L2

// Columns of a tile for K inputs: whole blocks, at least one.
int64_t TileWidth(int64_t k) {
  return std::max<int64_t>(1, kTileBudget / (k * 2) / jaxrunner_cpu::kTileColumns) * jaxrunner_cpu::kTileColumns;
}

// The primitive for a [K, width] tile at M rows, created once (see PrimitiveFor).
const Primitive& TilePrimitiveFor(int64_t m, int64_t k, int64_t width) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, int64_t>, std::unique_ptr<Primitive>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto key = std::make_tuple(m, k, width);
  auto found = cache.find(key);
  if (found != cache.end()) return *found->second;
  auto made = std::make_unique<Primitive>();
  made->x = dnnl::memory::desc({m, k}, dt::bf16, tag::ab);
  made->w = dnnl::memory::desc({k, width}, dt::bf16, tag::BA16a64b2a);  // dequantize_tile.h's layout
  made->y = dnnl::memory::desc({m, width}, dt::f32, tag::ab);
  Finish(*made);
  return *cache.emplace(key, std::move(made)).first->second;
}

struct QuantCall {
  const void* x;  // [m, k] bf16
  jaxrunner_cpu::QuantView w;
  float* y;       // [m, n]
  int64_t m;
};

// A 64-byte aligned buffer of this thread that grows to the largest size asked for.
template <typename T>
T* ThreadBuffer(int64_t count) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<void, Free> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < count) {
    buffer.reset(std::aligned_alloc(64, (count * sizeof(T) + 63) / 64 * 64));
    if (!buffer) throw std::bad_alloc();
    capacity = count;
  }
  return static_cast<T*>(buffer.get());
}

// Half `index` of a weight-only product, on the calling thread alone, tile by tile.
void RunQuantHalf(const void* context, int64_t index) {
  const QuantCall& call = *static_cast<const QuantCall*>(context);
  const int64_t n = call.w.n, k = call.w.k, first = FirstHalfWidth(n);
  const int64_t begin = index == 0 ? 0 : first, end = index == 0 ? first : n;
  SingleThreaded single;  // the other half has the other core
  const int64_t width = TileWidth(k);
  uint16_t* tile = ThreadBuffer<uint16_t>(jaxrunner_cpu::TileBytes(k, width) / 2);
  float* out = ThreadBuffer<float>(call.m * width);
  for (int64_t n0 = begin; n0 < end; n0 += width) {
    const int64_t columns = std::min(width, end - n0);
    jaxrunner_cpu::DequantizeTile(call.w, n0, columns, tile);
    const bool whole = columns == n;
    Execute(TilePrimitiveFor(call.m, k, columns), call.x, tile, whole ? call.y : out);
    if (!whole) PlaceColumns(out, call.y, call.m, n, n0, columns);
  }
}

ffi::Error QuantMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer packed, ffi::AnyBuffer scales,
                       ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> y, int64_t has_offsets) {
  using ffi::DataType;
  const auto xd = x.dimensions(), pd = packed.dimensions(), sd = scales.dimensions();
  const bool int4 = packed.element_type() == DataType::U8, f16 = scales.element_type() == DataType::F16;
  if (x.element_type() != DataType::BF16 || (!int4 && packed.element_type() != DataType::S8) ||
      (!f16 && scales.element_type() != DataType::F32) || offsets.element_type() != scales.element_type())
    return ffi::Error::InvalidArgument("onednn quantized matmul: x bf16, packed uint8 or int8, scales and offsets "
                                       "both f32 or both f16");
  if (xd.size() != 2 || pd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("onednn quantized matmul: all operands must be matrices");
  const int64_t m = xd[0], k = xd[1], n = pd[0], groups = sd[1];
  if (m < 1 || pd[1] * (int4 ? 2 : 1) != k || sd[0] != n || groups < 1 || k % groups != 0 ||
      (k / groups) % jaxrunner_cpu::kTileInputs != 0)
    return ffi::Error::InvalidArgument("onednn quantized matmul: shapes do not match, or groups are not whole runs of 32");
  if ((has_offsets != 0) != int4 || (int4 && (offsets.dimensions().size() != 2 || offsets.dimensions()[0] != n ||
                                               offsets.dimensions()[1] != groups)))
    return ffi::Error::InvalidArgument("onednn quantized matmul: int4 takes offsets [N, G] like scales, int8 none");
  if (!__builtin_cpu_supports("avx512bf16"))
    return ffi::Error::InvalidArgument("onednn quantized matmul: this CPU has no AVX512-BF16");
  const QuantCall call{x.untyped_data(),
                       {packed.untyped_data(), scales.untyped_data(), has_offsets ? offsets.untyped_data() : nullptr,
                        n, k, groups, int4, f16},
                       static_cast<float*>(y->untyped_data()), m};
  try {
    RunHalves(pool, m, RunQuantHalf, &call, FirstHalfWidth(n) < n ? 2 : 1);
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string("onednn quantized matmul: ") + err.what());
  }
  return ffi::Error::Success();
}

// The same product for a weight laid out as panels (kernels/quant_panels.py): the tiles come out
// the same, bit for bit.
ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                       ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> y, int64_t has_offsets, int64_t int4) {
  using ffi::DataType;
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  const bool f16 = scales.element_type() == DataType::F16;
  if (x.element_type() != DataType::BF16 || codes.element_type() != DataType::U8 ||
      (!f16 && scales.element_type() != DataType::F32) || offsets.element_type() != scales.element_type())
    return ffi::Error::InvalidArgument("onednn panel matmul: x bf16, codes uint8, scales and offsets both f32 or "
                                       "both f16");
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("onednn panel matmul: all operands must be matrices");
  const int64_t m = xd[0], k = xd[1], n = cd[0] * 16, runs = k / jaxrunner_cpu::kTileInputs, groups = sd[1] / 16;
  if (m < 1 || k % jaxrunner_cpu::kTileInputs != 0 || cd[1] != runs * (int4 ? 256 : 512) || sd[0] != cd[0] ||
      sd[1] % 16 != 0 || groups < 1 || runs % groups != 0)
    return ffi::Error::InvalidArgument("onednn panel matmul: shapes do not match, or groups are not whole runs of 32");
  if (has_offsets != int4 || (int4 && (offsets.dimensions().size() != 2 || offsets.dimensions()[0] != sd[0] ||
                                       offsets.dimensions()[1] != sd[1])))
    return ffi::Error::InvalidArgument("onednn panel matmul: int4 takes offsets shaped like scales, int8 none");
  if (!__builtin_cpu_supports("avx512bf16"))
    return ffi::Error::InvalidArgument("onednn panel matmul: this CPU has no AVX512-BF16");
  QuantCall call{x.untyped_data(),
                 {codes.untyped_data(), scales.untyped_data(), has_offsets ? offsets.untyped_data() : nullptr, n, k,
                  groups, int4 != 0, f16},
                 static_cast<float*>(y->untyped_data()), m};
  call.w.panels = true;
  try {
    RunHalves(pool, m, RunQuantHalf, &call, FirstHalfWidth(n) < n ? 2 : 1);
  } catch (const std::exception& err) {
    return ffi::Error::Internal(std::string("onednn panel matmul: ") + err.what());
  }
  return ffi::Error::Success();
}

// Plain W ([K, N], or [N, K] when transposed) to packed bytes (to_packed), or back.
ffi::Error Reorder(void* plain, uint8_t* packed, int64_t k, int64_t n, bool bf16, bool transposed, bool to_packed) {
  try {
    const Layout& layout = PackedLayout(k, n, bf16);
    const int64_t item = bf16 ? 2 : 4;
    dnnl::stream stream(Engine());
    if (to_packed) std::memset(packed, 0, layout.bytes);  // padding and gaps: defined bytes
    for (const Half& half : layout.halves) {
      const dnnl::memory::dims strides = transposed ? dnnl::memory::dims{1, k} : dnnl::memory::dims{n, 1};
      uint8_t* base = static_cast<uint8_t*>(plain) + (transposed ? half.n0 * k : half.n0) * item;
      dnnl::memory plain_half(dnnl::memory::desc({k, half.n}, DataType(bf16), strides), Engine(), base);
      dnnl::memory packed_half(half.packed, Engine(), packed + half.offset);
      dnnl::memory& from = to_packed ? plain_half : packed_half;
      dnnl::memory& to = to_packed ? packed_half : plain_half;
      dnnl::reorder(from, to).execute(stream, from, to);
    }
    stream.wait();
  } catch (const dnnl::error& err) {
    return ffi::Error::Internal(std::string("onednn pack: ") + err.what());
  }
  return ffi::Error::Success();
}

ffi::Error Pack(ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> packed, int64_t transposed) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || !IsFloat(w.element_type()))
    return ffi::Error::InvalidArgument("onednn pack: w [K, N] or [N, K], bf16 or float32");
  const int64_t k = transposed ? wd[1] : wd[0], n = transposed ? wd[0] : wd[1];
  if (PackedBytes(k, n, IsBf16(w.element_type())) != int64_t(packed->dimensions()[0]))
    return ffi::Error::InvalidArgument("onednn pack: the output is not the packed size");
  return Reorder(w.untyped_data(), static_cast<uint8_t*>(packed->untyped_data()), k, n, IsBf16(w.element_type()),
                 transposed != 0, true);
}

ffi::Error Unpack(ffi::AnyBuffer packed, ffi::Result<ffi::AnyBuffer> w, int64_t transposed) {
  const auto wd = w->dimensions();
  if (wd.size() != 2 || !IsFloat(w->element_type()))
    return ffi::Error::InvalidArgument("onednn unpack: w [K, N] or [N, K], bf16 or float32");
  const int64_t k = transposed ? wd[1] : wd[0], n = transposed ? wd[0] : wd[1];
  if (PackedBytes(k, n, IsBf16(w->element_type())) != int64_t(packed.dimensions()[0]))
    return ffi::Error::InvalidArgument("onednn unpack: the input is not the packed size");
  return Reorder(w->untyped_data(), static_cast<uint8_t*>(packed.untyped_data()), k, n, IsBf16(w->element_type()),
                 transposed != 0, false);
}

}  // namespace

// Bytes of a packed [K, N] weight (bf16 != 0: bfloat16, else float32); -1 when oneDNN has no
// matmul for it.
extern "C" int64_t JaxrunnerOnednnPackedBytes(int64_t k, int64_t n, int64_t bf16) { return PackedBytes(k, n, bf16 != 0); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuOnednnMatmul, PackedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16 or f32
                                  .Arg<ffi::AnyBuffer>()  // w: packed bytes (JaxrunnerCpuOnednnPack)
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32
                                  .Attr<int64_t>("n"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuOnednnPack, Pack,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // w [K, N], or [N, K] when transposed
                                  .Ret<ffi::AnyBuffer>()  // packed bytes
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuOnednnUnpack, Unpack,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // packed bytes
                                  .Ret<ffi::AnyBuffer>()  // w [K, N], or [N, K] when transposed
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuOnednnQuantMatmul, QuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // packed [N, K/2] uint8 (int4) or [N, K] int8
                                  .Arg<ffi::AnyBuffer>()  // scales [N, G] f32 or f16
                                  .Arg<ffi::AnyBuffer>()  // offsets [N, G] like scales (int4; a placeholder for int8)
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32
                                  .Attr<int64_t>("has_offsets"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuOnednnPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16
                                  .Arg<ffi::AnyBuffer>()  // codes [N / 16, K / 32 * (256 or 512)] uint8
                                  .Arg<ffi::AnyBuffer>()  // scales [N / 16, G * 16] f32 or f16
                                  .Arg<ffi::AnyBuffer>()  // offsets like scales (int4; a placeholder for int8)
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32
                                  .Attr<int64_t>("has_offsets")
                                  .Attr<int64_t>("int4"));
