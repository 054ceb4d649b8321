// The SiLU-gated product of a gated MLP for XLA:CPU, as an XLA FFI custom call: out [T, I] =
// silu(gate) * up, from the float32 [T, 2I] projection with gate and up interleaved column by
// column (jaxrunner/models/params.py's w_gate_up), rounded to out's dtype (bfloat16 or float32).
//
// Why: XLA:CPU's fusion of the same reads the interleaved pairs a lane at a time: SmolLM2's took
// about a tenth of a 256-token step. Here 32 floats become 16 gates and 16 ups with two shuffles,
// and the exponential is vec.h's. Items of a few thousand outputs spread over XLA's intra-op pool,
// whose threads the projection's dot has just woken (the native kernels' one helper thread, which
// sleeps between their calls, did no better).
//
// silu(g) = g * sigmoid(g) with e = exp(-|g|) <= 1, so nothing overflows: sigmoid(g) = 1 / (1 + e)
// for g > 0, e / (1 + e) otherwise. Below -87, exp flushes to 0 and so does silu (XLA gives a
// float32 value under 1e-35 there). A NaN gate or up gives NaN.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr int64_t kOutputsPerItem = 8192;  // outputs per work item

template <typename V, typename IV>  // V: float vector, IV: int32 vector of the same lanes
inline V SiluLanes(V g) {
  const V positive = g > 0.0f ? g : V{} - g;  // |g|, NaN kept
  const V e = ExpLanes<V, IV>(V{} - positive);
  const V numerator = g > 0.0f ? g : g * e;
  return numerator / (1.0f + e);
}

// silu(gate) * up of 16 interleaved (gate, up) pairs at p.
inline F16 GatedPairs(const float* p) {
  const F16 a = Load(p), b = Load(p + kLanes);
#if JAXRUNNER_F16_HALVES
  const F8 gate_lo = __builtin_shufflevector(a.lo, a.hi, 0, 2, 4, 6, 8, 10, 12, 14);
  const F8 up_lo = __builtin_shufflevector(a.lo, a.hi, 1, 3, 5, 7, 9, 11, 13, 15);
  const F8 gate_hi = __builtin_shufflevector(b.lo, b.hi, 0, 2, 4, 6, 8, 10, 12, 14);
  const F8 up_hi = __builtin_shufflevector(b.lo, b.hi, 1, 3, 5, 7, 9, 11, 13, 15);
  return {SiluLanes<F8, I8>(gate_lo) * up_lo, SiluLanes<F8, I8>(gate_hi) * up_hi};
#else
  const F16 gate = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const F16 up = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return SiluLanes<F16, I16>(gate) * up;
#endif
}

template <typename OT>
struct Call {
  const float* gate_up;  // [rows, 2 * width]
  OT* out;               // [rows, width]
  int64_t outputs;       // rows * width, a multiple of kLanes
};

// Outputs [item * kOutputsPerItem, ...) in row-major order: output i is the pair at 2i.
template <typename OT>
void RunItem(const void* context, int64_t item) {
  const Call<OT>& call = *static_cast<const Call<OT>*>(context);
  const int64_t end = std::min(call.outputs, (item + 1) * kOutputsPerItem);
  for (int64_t i = item * kOutputsPerItem; i < end; i += kLanes) Store(GatedPairs(call.gate_up + 2 * i), call.out + i);
}

ffi::Error SiluMul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> gate_up, ffi::Result<ffi::AnyBuffer> out) {
  const auto gd = gate_up.dimensions(), od = out->dimensions();
  if (gd.size() != 2 || od.size() != 2 || gd[0] != od[0] || gd[1] != 2 * od[1] || od[1] % kLanes != 0)
    return ffi::Error::InvalidArgument("silu_mul: gate_up [T, 2I] float32 and out [T, I], I a multiple of 16");
  const int64_t outputs = od[0] * od[1], items = (outputs + kOutputsPerItem - 1) / kOutputsPerItem;
  if (out->element_type() == ffi::DataType::F32) {
    const Call<float> call{gate_up.typed_data(), static_cast<float*>(out->untyped_data()), outputs};
    RunItems<int>(pool, items, [call](int64_t item, int&) { RunItem<float>(&call, item); });
  } else if (out->element_type() == ffi::DataType::BF16) {
    const Call<uint16_t> call{gate_up.typed_data(), static_cast<uint16_t*>(out->untyped_data()), outputs};
    RunItems<int>(pool, items, [call](int64_t item, int&) { RunItem<uint16_t>(&call, item); });
  } else {
    return ffi::Error::InvalidArgument("silu_mul: out must be float32 or bfloat16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuSiluMul, SiluMul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate_up [T, 2I], pairs interleaved
                                  .Ret<ffi::AnyBuffer>());       // out [T, I]
