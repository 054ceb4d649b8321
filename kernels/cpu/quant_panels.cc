// Weight-only quantized matmul on weights laid out at load as panels of sixteen outputs, for
// XLA:CPU with AVX512-VNNI, as an XLA FFI custom call: y [M, N] float32 = x [M, K] . W^T, any
// M >= 1, x float32 or bfloat16. W is int4 or int8 as quant_matmul.cc describes it, rearranged
// once by jaxrunner/models/panel_weights.py: `codes` uint8 [N / 16, runs * 256] (int4) or
// [N / 16, runs * 512] (int8, biased to unsigned), `scales` and `offsets` [N / 16, G * 16], both
// float32 or both float16 (quant_gemm_vnni.h's StoredPanel has the byte order).
//
// Why: the weights as a GGUF stores them (one output's codes after another) make each output's
// integer dot products end in a sum across lanes, and each block of codes needs its own
// conversion and scaling (quant_dot.h); the panel GEMM (quant_gemm_vnni.h) avoids both but
// rearranged every panel at every call, which cost as much as a few rows' products. Laid out once,
// sixteen outputs fill one vector's lanes, a run's sums stay int32 until the run ends, and one
// call reads the codes as one stream, for one row as for many.
//
// x is rounded to 16-bit integers per run of 32 inputs as for the few-row walk (QuantizedX); with
// x_int8 (the "w4a8" quantization) it is first put on its int8 grid, so one int8 plane carries it.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "helper_thread.h"
#include "quant_dot.h"
#include "quant_dot8.h"
#include "quant_gemm_vnni.h"
#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#if JAXRUNNER_VNNI_GEMM

namespace {

using namespace jaxrunner_cpu;

constexpr int64_t kPanelOutputs = kVnniPanelOutputs;
constexpr int64_t kPooledPanelBytes = int64_t(4) << 20;  // codes from which XLA's pool joins (as quant_matmul.cc)

struct PanelProblem {
  int64_t rows, k, n, groups;
  const QuantizedX* x;
  const uint8_t* codes;  // [n / 16, panel_bytes]
  const void* scales;    // [n / 16, groups * 16]
  const void* offsets;   // like scales, or null
  float* y;              // [rows, n]
  bool half_scales, int4;

  int64_t PanelBytes() const { return (k / kRunInputs) * (int4 ? 256 : 512); }
};

template <bool kInt4>
void PanelOne(const PanelProblem& p, int64_t panel) {
  const int64_t value_bytes = p.groups * kPanelOutputs * (p.half_scales ? 2 : 4);
  const auto at = [&](const void* values) {
    return values == nullptr ? nullptr : static_cast<const char*>(values) + panel * value_bytes;
  };
  const StoredPanel<kInt4> stored{p.codes + panel * p.PanelBytes(), at(p.scales), at(p.offsets), p.half_scales,
                                  (p.k / kRunInputs) / p.groups};
  const int64_t n0 = panel * kPanelOutputs;
  if (p.x->OnePlane()) VnniPanelPasses<kInt4, true>(stored, *p.x, p.rows, p.n, n0, kPanelOutputs, p.y);
  else VnniPanelPasses<kInt4, false>(stored, *p.x, p.rows, p.n, n0, kPanelOutputs, p.y);
}

// Work items of four panels: each thread then reads a few contiguous streams a call (one panel
// per item read one row's weights from memory at 0.8x the rate).
constexpr int64_t kPanelsPerItem = 4;

template <bool kInt4>
void PanelItem(const void* problem, int64_t item) {
  const PanelProblem& p = *static_cast<const PanelProblem*>(problem);
  const int64_t end = std::min(p.n / kPanelOutputs, (item + 1) * kPanelsPerItem);
  for (int64_t panel = item * kPanelsPerItem; panel < end; ++panel) PanelOne<kInt4>(p, panel);
}

template <bool kInt4>
void RunPanels(ffi::ThreadPool& pool, const PanelProblem& p) {
  const int64_t panels = p.n / kPanelOutputs, items = (panels + kPanelsPerItem - 1) / kPanelsPerItem;
  if (pool.num_threads() <= kHelperThreads || (p.rows <= 16 && panels * p.PanelBytes() < kPooledPanelBytes))
    return HelperThread::Run(PanelItem<kInt4>, &p, items);
  struct NoScratch {};
  RunItems<NoScratch>(pool, items, [p](int64_t item, NoScratch&) { PanelItem<kInt4>(&p, item); });
}

ffi::Error QuantMatmulPanels(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                             ffi::AnyBuffer offsets, ffi::Result<ffi::AnyBuffer> y, int64_t has_offsets,
                             int64_t int4, int64_t x_int8) {
  using ffi::DataType;
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions(), yd = y->dimensions();
  const bool bf16 = x.element_type() == DataType::BF16;
  const auto value_type = scales.element_type();
  if ((!bf16 && x.element_type() != DataType::F32) || codes.element_type() != DataType::U8 ||
      (value_type != DataType::F32 && value_type != DataType::F16) || offsets.element_type() != value_type ||
      y->element_type() != DataType::F32)
    return ffi::Error::InvalidArgument("panel matmul: x bf16 or f32, codes uint8, scales and offsets both f32 "
                                       "or both f16, y f32");
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("panel matmul: all operands must be matrices");
  const int64_t rows = xd[0], k = xd[1], panels = cd[0], n = panels * kPanelOutputs;
  const int64_t runs = k / kRunInputs, groups = sd[1] / kPanelOutputs;
  if (rows < 1 || k % kRunInputs != 0 || cd[1] != runs * (int4 ? 256 : 512) || sd[0] != panels ||
      sd[1] % kPanelOutputs != 0 || groups < 1 || runs % groups != 0 || yd[0] != rows || yd[1] != n)
    return ffi::Error::InvalidArgument("panel matmul: shapes do not match, or groups are not whole runs of 32");
  if (has_offsets && (offsets.dimensions().size() != 2 || offsets.dimensions()[0] != panels ||
                      offsets.dimensions()[1] != sd[1]))
    return ffi::Error::InvalidArgument("panel matmul: offsets must be shaped like scales");
  std::vector<float> x32(rows * k);
  if (bf16) {
    const uint16_t* x16 = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t i = 0; i < rows * k; ++i) x32[i] = ToF32(x16[i]);
  } else {
    std::memcpy(x32.data(), x.untyped_data(), rows * k * sizeof(float));
  }
  if (x_int8) RoundRunsToInt8Grid(x32.data(), rows, k);
  const QuantizedX qx(x32.data(), rows, k, int4 != 0);
  const PanelProblem p{rows, k, n, groups, &qx, static_cast<const uint8_t*>(codes.untyped_data()),
                       scales.untyped_data(), has_offsets ? offsets.untyped_data() : nullptr,
                       static_cast<float*>(y->untyped_data()), value_type == DataType::F16, int4 != 0};
  if (int4) RunPanels<true>(pool, p);
  else RunPanels<false>(pool, p);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuQuantMatmulPanels, QuantMatmulPanels,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [M, K] bf16 or f32
                                  .Arg<ffi::AnyBuffer>()  // codes [N / 16, runs * 256 or 512] uint8
                                  .Arg<ffi::AnyBuffer>()  // scales [N / 16, G * 16] f32 or f16
                                  .Arg<ffi::AnyBuffer>()  // offsets like scales (ignored without has_offsets)
                                  .Ret<ffi::AnyBuffer>()  // y [M, N] f32
                                  .Attr<int64_t>("has_offsets")
                                  .Attr<int64_t>("int4")
                                  .Attr<int64_t>("x_int8"));

#else  // no AVX512-VNNI: the layout is never chosen (JaxrunnerCpuStoredPanels), and a call says why

namespace {
ffi::Error NoPanels(ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer>,
                    int64_t, int64_t, int64_t) {
  return ffi::Error::InvalidArgument("panel matmul: this build has no AVX512-VNNI kernels (see native.stored_panels)");
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuQuantMatmulPanels, NoPanels,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("has_offsets")
                                  .Attr<int64_t>("int4")
                                  .Attr<int64_t>("x_int8"));

#endif

// Whether weights laid out as panels can be multiplied here (AVX512-VNNI builds).
extern "C" int JaxrunnerCpuStoredPanels() {
#if JAXRUNNER_VNNI_GEMM
  return 1;
#else
  return 0;
#endif
}
