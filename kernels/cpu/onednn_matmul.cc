// Matmul through oneDNN for XLA:CPU, as an XLA FFI custom call: y [M, N] float32 = x [M, K] . W,
// x and W both bfloat16 or both float32, W either [K, N] (a projection) or [N, K] (the tied
// embedding used as the LM head).
//
// Why: XLA:CPU's bf16 dot leaves AMX unused; oneDNN's brgemm kernels use it (the library torch and
// vLLM's CPU build call), and ran a 1B model's bf16 projections faster than XLA's dot. Which products
// come here is decided by the model (jaxrunner/models/linear.py) from the choice made at start-up
// (jaxrunner/kernels/platform_support.py, a table of where it was measured faster).
//
// One primitive per (M, K, N, dtype, layout), created on its first call -- during warm-up, which
// runs every bucketed shape -- and kept for the life of the process: creating one costs far more
// than running it. The weights stay in the layout the model holds them in (plain row-major), so
// nothing is reordered per call. oneDNN runs on its own OpenMP threads; the calling XLA thread
// waits for it, so the two pools do not compete.
//
// Products of two bf16 values are exact in float32 and oneDNN accumulates in float32, as XLA's
// bf16 x bf16 -> f32 dot does; only the order of the additions differs (float32 likewise).
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using Key = std::tuple<int64_t, int64_t, int64_t, int, bool>;  // M, K, N, dtype, W is [N, K]

struct Cached {
  dnnl::memory::desc x, w, y;
  dnnl::matmul primitive;
};

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The primitive for one shape, created once. A primitive is immutable after creation and oneDNN
// allows executing it from several threads at once, so a pointer to it outlives the lock.
const Cached& Primitive(const Key& key) {
  static std::mutex mutex;
  static std::map<Key, std::unique_ptr<Cached>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto found = cache.find(key);
  if (found != cache.end()) return *found->second;
  auto [m, k, n, bf16, transposed] = key;
  using dt = dnnl::memory::data_type;
  using tag = dnnl::memory::format_tag;
  dt in = bf16 ? dt::bf16 : dt::f32;
  auto cached = std::make_unique<Cached>();
  cached->x = dnnl::memory::desc({m, k}, in, tag::ab);
  cached->w = dnnl::memory::desc({k, n}, in, transposed ? tag::ba : tag::ab);
  cached->y = dnnl::memory::desc({m, n}, dt::f32, tag::ab);
  dnnl::matmul::primitive_desc pd(Engine(), cached->x, cached->w, cached->y);
  cached->primitive = dnnl::matmul(pd);
  return *cache.emplace(key, std::move(cached)).first->second;
}

ffi::Error OnednnMatmul(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y, int64_t transposed) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || x.element_type() != w.element_type()) {
    return ffi::Error::InvalidArgument("onednn_matmul: x [M, K] and w, 2-D and of one dtype");
  }
  bool bf16 = x.element_type() == ffi::DataType::BF16;
  if (!bf16 && x.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("onednn_matmul: bf16 or float32 operands");
  }
  int64_t m = xd[0], k = xd[1], n = transposed ? wd[0] : wd[1];
  if ((transposed ? wd[1] : wd[0]) != k) return ffi::Error::InvalidArgument("onednn_matmul: K differs");
  try {
    const Cached& cached = Primitive({m, k, n, bf16, transposed != 0});
    dnnl::stream stream(Engine());
    dnnl::memory xm(cached.x, Engine(), x.untyped_data());
    dnnl::memory wm(cached.w, Engine(), w.untyped_data());
    dnnl::memory ym(cached.y, Engine(), y->untyped_data());
    cached.primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym}});
    stream.wait();
  } catch (const dnnl::error& err) {
    return ffi::Error::Internal(std::string("onednn_matmul: ") + err.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuOnednnMatmul, OnednnMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16 or f32
                                  .Arg<ffi::AnyBuffer>()  // w [K, N] or [N, K], x's dtype
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32
                                  .Attr<int64_t>("transposed"));
