// 8-bit float KV rows (kv_cache_dtype "fp8_e4m3" / "fp8_e5m2"): float32 -> fp8 for the page write,
// fp8 -> 16 float32 lanes for the attention kernel's loads.
//
// Why fp8 pools: half the bytes of bf16 ones, so a pool holds twice the tokens, and a decode
// step reads half as much.
//
// e4m3fn's NaN code (S.1111.111) and e5m2's infinities and NaNs read as large finite values:
// the write saturates to the largest finite value, so a pool holds none of them unless the model
// produced a NaN.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace jaxrunner_cpu {

struct E4M3 { uint8_t bits; };  // float8_e4m3fn: bias 7, no infinities, largest 448
struct E5M2 { uint8_t bits; };  // float8_e5m2: bias 15, largest finite 57344

template <typename T> struct Fp8Format;
template <> struct Fp8Format<E4M3> {
  static constexpr int kMantissa = 3, kBias = 7;
  static constexpr float kMax = 448.0f;
  static constexpr uint8_t kNan = 0x7f;
};
template <> struct Fp8Format<E5M2> {
  static constexpr int kMantissa = 2, kBias = 15;
  static constexpr float kMax = 57344.0f;
  static constexpr uint8_t kNan = 0x7f;
};

// float32 -> fp8, rounding to nearest even after saturating to the largest finite value (what
// ``jnp.clip(x, -max, max).astype(fp8)`` gives, kernels/kv_write.py); NaN stays NaN.
template <typename T>
inline uint8_t Fp8Bits(float x) {
  using F = Fp8Format<T>;
  constexpr int M = F::kMantissa;
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  if ((u & 0x7fffffffu) > 0x7f800000u) return sign | F::kNan;
  const float a = std::fmin(std::fabs(x), F::kMax);
  const float min_normal = std::ldexp(1.0f, 1 - F::kBias);
  if (a < min_normal)  // subnormal: a count of 2^(1 - bias - M); 2^M carries into the exponent
    return sign | uint8_t(std::nearbyint(std::ldexp(a, F::kBias - 1 + M)));
  std::memcpy(&u, &a, sizeof u);
  u += (1u << (22 - M)) - 1 + ((u >> (23 - M)) & 1u);  // round the mantissa to M bits, ties to even
  const uint32_t exponent = (u >> 23) - 127 + F::kBias, mantissa = (u >> (23 - M)) & ((1u << M) - 1);
  return sign | uint8_t((exponent << M) | mantissa);
}

inline void FromF32(float x, E4M3* out) { out->bits = Fp8Bits<E4M3>(x); }
inline void FromF32(float x, E5M2* out) { out->bits = Fp8Bits<E5M2>(x); }

// The IEEE float16 of an fp8 value (times 2^-8 for e4m3), whose widening to float32 is exact and
// one instruction with F16C, subnormals included (a float32 built bit by bit would be subnormal
// for them, and XLA's threads run with denormals flushed to zero). e5m2 is the upper byte of a
// float16. e4m3's exponent and mantissa bits move up 7 places and its sign up 8: sign-extended
// to 16 bits and shifted by 7, the byte lands both, and the mask drops the extension's copy of
// the sign in bit 14.
constexpr uint16_t kE4M3HalfMask = 0xbf80;
inline uint16_t HalfBits(E5M2 x) { return uint16_t(x.bits) << 8; }
inline uint16_t HalfBits(E4M3 x) { return uint16_t(int16_t(int8_t(x.bits)) << 7) & kE4M3HalfMask; }
constexpr float HalfScale(E5M2) { return 1.0f; }
constexpr float HalfScale(E4M3) { return 256.0f; }

inline float ToF32(E4M3 x) { return HalfToF32(HalfBits(x)) * HalfScale(x); }
inline float ToF32(E5M2 x) { return HalfToF32(HalfBits(x)) * HalfScale(x); }

typedef int8_t B16 __attribute__((vector_size(16)));
typedef uint8_t UB16 __attribute__((vector_size(16)));
typedef int16_t S16 __attribute__((vector_size(32)));

inline H16 HalfBits16(const E5M2* p) {
  UB16 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, H16) << 8;
}
inline H16 HalfBits16(const E4M3* p) {
  B16 b;
  std::memcpy(&b, p, sizeof b);
  const S16 h = (__builtin_convertvector(b, S16) << 7) & int16_t(kE4M3HalfMask);
  return reinterpret_cast<const H16&>(h);
}

// 16 fp8 values -> 16 float32 lanes: four or six vector operations (widen, shift, [mask,] convert
// from float16, [scale]).
template <typename T>
inline F16 LoadFp8(const T* p) {
  const H16 halves = HalfBits16(p);
#if defined(__AVX512F__)
  __m256i h;
  std::memcpy(&h, &halves, sizeof h);
  const __m512 wide = _mm512_cvtph_ps(h);
  F16 v;
  std::memcpy(&v, &wide, sizeof v);
#elif defined(__F16C__)
  __m128i lo, hi;
  std::memcpy(&lo, &halves, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&halves) + sizeof lo, sizeof hi);
  const __m256 a = _mm256_cvtph_ps(lo), b = _mm256_cvtph_ps(hi);
  F16 v;  // two F8 halves, or 16 contiguous floats
  std::memcpy(&v, &a, sizeof a);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof a, &b, sizeof b);
#else
  alignas(64) float row[kLanes];
  for (int l = 0; l < kLanes; ++l) row[l] = HalfToF32(halves[l]);
  F16 v = Load(row);
#endif
  return HalfScale(T{}) == 1.0f ? v : v * Splat(HalfScale(T{}));
}

inline F16 Load(const E4M3* p) { return LoadFp8(p); }
inline F16 Load(const E5M2* p) { return LoadFp8(p); }

}  // namespace jaxrunner_cpu
