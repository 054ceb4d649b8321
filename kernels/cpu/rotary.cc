// RoPE for XLA:CPU, as an XLA FFI custom call: the grouped float32 q/k/v projection [T, Hkv, G + 2, D]
// (each KV head's G queries, then its k, then its v: jaxrunner/models/layers.py) split into
// q [T, Hkv * G, D] and k [T, Hkv, D] rotated, and v [T, Hkv, D] as it is; cos and sin [T, D] in
// HF's rotate-half layout (each half repeated).
//
// Why: XLA:CPU ran the rotation as a [T * (G + 1) * Hkv, D] x [D, D] signed-permutation product
// (its fusion of the slices and concatenate was slower still), then sliced q, k and v out of the
// result: about a twentieth of a SmolLM2 step. Here each row is read once and its halves swapped
// in registers.
//
// Bit for bit what layers.apply_rope gives under XLA when it optimizes: out = fma(x, cos,
// rotate_half(x) * sin), the product with sin rounded first (XLA's contraction, checked against its
// output; unoptimized, XLA rounds x * cos too).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr int64_t kRowsPerItem = 16;  // token rows per work item

// fma(a, b, c) lane by lane, rounded once.
inline F16 FusedMulAdd(const F16& a, const F16& b, const F16& c) {
#if defined(__AVX512F__) && !JAXRUNNER_F16_HALVES
  const __m512 r = _mm512_fmadd_ps(reinterpret_cast<const __m512&>(a), reinterpret_cast<const __m512&>(b),
                                   reinterpret_cast<const __m512&>(c));
  return reinterpret_cast<const F16&>(r);
#elif JAXRUNNER_F16_HALVES && defined(__FMA__)
  F16 out;
  const __m256 lo = _mm256_fmadd_ps(reinterpret_cast<const __m256&>(a.lo), reinterpret_cast<const __m256&>(b.lo),
                                    reinterpret_cast<const __m256&>(c.lo));
  const __m256 hi = _mm256_fmadd_ps(reinterpret_cast<const __m256&>(a.hi), reinterpret_cast<const __m256&>(b.hi),
                                    reinterpret_cast<const __m256&>(c.hi));
  std::memcpy(&out.lo, &lo, sizeof lo);
  std::memcpy(&out.hi, &hi, sizeof hi);
  return out;
#else
  alignas(64) float x[kLanes], y[kLanes], z[kLanes];
  std::memcpy(x, &a, sizeof x);
  std::memcpy(y, &b, sizeof y);
  std::memcpy(z, &c, sizeof z);
  for (int l = 0; l < kLanes; ++l) x[l] = std::fma(x[l], y[l], z[l]);
  return Load(x);
#endif
}

// One head's rotated row: out[i] = fma(x[i], cos[i], rot[i] * sin[i]), rot = [-x2, x1].
inline void RotateRow(const float* x, const float* cos, const float* sin, float* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const F16 first = Load(x + i), second = Load(x + half + i);
    const F16 rotated_first = (F16{} - second) * Load(sin + i);  // 0 - x: -x, exactly
    const F16 rotated_second = first * Load(sin + half + i);
    Store(FusedMulAdd(first, Load(cos + i), rotated_first), out + i);
    Store(FusedMulAdd(second, Load(cos + half + i), rotated_second), out + half + i);
  }
}

struct Problem {
  const float *qkv, *cos, *sin;
  float *q, *k, *v;
  int64_t tokens, kv_heads, group, dim;
};

void RunRows(const Problem& p, int64_t item) {
  const int64_t t1 = std::min(p.tokens, (item + 1) * kRowsPerItem), D = p.dim, G = p.group;
  for (int64_t t = item * kRowsPerItem; t < t1; ++t) {
    const float *cos = p.cos + t * D, *sin = p.sin + t * D;
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      const float* src = p.qkv + (t * p.kv_heads + h) * (G + 2) * D;
      for (int64_t g = 0; g < G; ++g) RotateRow(src + g * D, cos, sin, p.q + ((t * p.kv_heads + h) * G + g) * D, D);
      RotateRow(src + G * D, cos, sin, p.k + (t * p.kv_heads + h) * D, D);
      std::memcpy(p.v + (t * p.kv_heads + h) * D, src + (G + 1) * D, D * sizeof(float));
    }
  }
}

ffi::Error Rotary(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> cos,
                  ffi::Buffer<ffi::F32> sin, ffi::Result<ffi::Buffer<ffi::F32>> q,
                  ffi::Result<ffi::Buffer<ffi::F32>> k, ffi::Result<ffi::Buffer<ffi::F32>> v) {
  const auto d = qkv.dimensions(), cd = cos.dimensions();
  if (d.size() != 4 || d[2] < 3 || d[3] % (2 * kLanes) != 0 || cd.size() != 2 || cd[0] != d[0] || cd[1] != d[3] ||
      sin.dimensions().size() != 2 || sin.dimensions()[0] != d[0] || sin.dimensions()[1] != d[3])
    return ffi::Error::InvalidArgument("rotary: qkv [T, Hkv, G + 2, D] (D a multiple of 32), cos and sin [T, D]");
  const Problem p{qkv.typed_data(), cos.typed_data(), sin.typed_data(), q->typed_data(), k->typed_data(),
                  v->typed_data(), d[0], d[1], d[2] - 2, d[3]};
  const int64_t items = (p.tokens + kRowsPerItem - 1) / kRowsPerItem;
  RunItems<int>(pool, items, [p](int64_t item, int&) { RunRows(p, item); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuRotary, Rotary,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // qkv [T, Hkv, G + 2, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cos [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sin [T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // q [T, Hkv * G, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // k [T, Hkv, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()); // v [T, Hkv, D]
