// 16-float vectors (GCC/Clang vector extensions: portable, and -march=native turns them into
// AVX-512 where there is one; with AVX2 and no AVX-512, a pair of 8-float halves; narrower ISAs
// split them), bfloat16 <-> float32, exp and prefetches: shared by the native CPU kernels.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace jaxrunner_cpu {

constexpr int kLanes = 16;  // floats per vector

typedef float F8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));
typedef uint16_t H16 __attribute__((vector_size(32)));

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: a 16-float vector is two 8-float halves. GCC has no register for a 64-byte vector
// extension without AVX-512, so it kept every such value (and arrays of them) in memory and moved
// it through general registers piece by piece: built for AVX2, the paged attention kernel ran
// decodes 4x and prefill chunks 10x slower than built for AVX-512 on the same CPU. Two 32-byte
// halves live in ymm registers.
#define JAXRUNNER_F16_HALVES 1
struct F16 {
  F8 lo, hi;
  F16& operator+=(const F16& o) { lo += o.lo; hi += o.hi; return *this; }
  F16& operator-=(const F16& o) { lo -= o.lo; hi -= o.hi; return *this; }
  F16& operator*=(const F16& o) { lo *= o.lo; hi *= o.hi; return *this; }
  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
inline F16 operator+(F16 a, const F16& b) { return a += b; }
inline F16 operator-(F16 a, const F16& b) { return a -= b; }
inline F16 operator*(F16 a, const F16& b) { return a *= b; }

inline F16 Load(const float* p) {
  F16 v;
  std::memcpy(&v.lo, p, sizeof v.lo);
  std::memcpy(&v.hi, p + 8, sizeof v.hi);
  return v;
}
inline F16 Load(const uint16_t* p) {  // bfloat16 -> float32: the bits move up 16 places
  const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
  const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))), 16);
  return {reinterpret_cast<F8>(_mm256_castsi256_ps(lo)), reinterpret_cast<F8>(_mm256_castsi256_ps(hi))};
}
inline F16 Splat(float x) { return {F8{} + x, F8{} + x}; }

inline float Sum(F16 v) {  // halving tree
  const F8 h = v.lo + v.hi;
  const F4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The four sums {sum(a), sum(b), sum(c), sum(d)} with one shuffle-and-add tree.
inline F4 Sum4(F16 a, F16 b, F16 c, F16 d) {
  const F8 a8 = a.lo + a.hi, b8 = b.lo + b.hi, c8 = c.lo + c.hi, d8 = d.lo + d.hi;
  const F8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);  // [a 4 | b 4]
  const F8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);  // [c 4 | d 4]
  const F8 x = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);  // [a 2 | b 2 | c 2 | d 2]
  return __builtin_shufflevector(x, x, 0, 2, 4, 6) + __builtin_shufflevector(x, x, 1, 3, 5, 7);
}
#else
typedef float F16 __attribute__((vector_size(64)));

inline F16 Load(const float* p) {
  F16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline F16 Load(const uint16_t* p) {  // bfloat16 -> float32: the bits move up 16 places
#if defined(__AVX512F__)
  // One widening load: GCC's lowering of the generic version below split it into 256-bit halves
  // (five instructions), which bounded the bf16 matmul's read rate.
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
  return reinterpret_cast<F16>(_mm512_castsi512_ps(u));
#else
  H16 h;
  std::memcpy(&h, p, sizeof h);
  U16 u = __builtin_convertvector(h, U16) << 16;
  F16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}
inline F16 Splat(float x) { return F16{} + x; }


inline float Sum(F16 v) {  // halving tree: 4 shuffle + add steps
  F8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  F4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// The four sums {sum(a), sum(b), sum(c), sum(d)} with one shuffle-and-add tree.
inline F4 Sum4(F16 a, F16 b, F16 c, F16 d) {
  const F16 ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const F16 cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // ab = [a 8 | b 8], cd = [c 8 | d 8] -> [a 4 | b 4 | c 4 | d 4]
  const F16 x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  // -> [a 2 | b 2 | c 2 | d 2], then pairs
  const F8 y = __builtin_shufflevector(x, x, 0, 1, 4, 5, 8, 9, 12, 13) +
               __builtin_shufflevector(x, x, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y, y, 0, 2, 4, 6) + __builtin_shufflevector(y, y, 1, 3, 5, 7);
}
#endif

inline float ToF32(float x) { return x; }
inline float ToF32(uint16_t bf16_bits) {
  uint32_t u = uint32_t(bf16_bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// IEEE float16 bits -> float32 (the scales of a GGUF's quantized blocks are kept as float16).
inline float HalfToF32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
  uint32_t bits;
  if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa * 2^-24, exact in float32
    float f = float(mantissa) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, sizeof f);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
#endif
}

// One float32 as float32, or as bfloat16 bits.
inline void FromF32(float x, float* out) { *out = x; }
inline void FromF32(float x, uint16_t* out) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *out = uint16_t((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *out = uint16_t(u >> 16);
}

// 16 lanes stored as float32, or as bfloat16 bits rounded as FromF32 rounds each lane.
inline void Store(const F16& v, float* out) { std::memcpy(out, &v, sizeof v); }
inline void Store(const F16& v, uint16_t* out) {
#if JAXRUNNER_F16_HALVES
  for (int l = 0; l < kLanes; ++l) FromF32(v[l], out + l);
#else
  U16 u;
  std::memcpy(&u, &v, sizeof u);
  const U16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const U16 bits = (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded;
  const H16 h = __builtin_convertvector(bits, H16);
  std::memcpy(out, &h, sizeof h);
#endif
}

// exp(x) for x <= 0 (a softmax after subtracting the max, a sigmoid of -|x|), 16 lanes at a
// time: 2^(x log2 e) split into 2^integer (exponent bits) and 2^fraction (degree-6 polynomial,
// relative error under 1e-7 in float32; a Taylor-like one had 6e-6 near fraction 1). The fraction
// comes from x minus integer * ln 2 in two parts (Cody-Waite), not from the rounded x log2 e,
// whose error grows with |x|. Lanes below -87 flush to 0. libm's expf is scalar and was most of an
// attention decode item's time.
template <typename V, typename IV>  // V: float vector, IV: int32 vector of the same lanes
inline V ExpLanes(V x) {
  const V low = V{} - 87.0f;
  x = x < low ? low : x;
  V t = x * 1.44269504088896341f;
  V fl = __builtin_convertvector(__builtin_convertvector(t, IV), V);
  fl = fl > t ? fl - 1.0f : fl;  // floor
  // ln 2 = 0.693145751953125 (exact with few bits, so fl * it is exact) + 1.4286068e-6
  V f = ((x - fl * 0.693145751953125f) - fl * 1.428606765330187e-6f) * 1.44269504088896341f;  // ~[0, 1)
  V p = V{} + 2.161285187501681e-4f;  // 1 + f q(f), q fitted to 2^f's relative error (minimax)
  p = p * f + 1.246786289076095e-3f;
  p = p * f + 9.675450005147105e-3f;
  p = p * f + 5.548528127245447e-2f;
  p = p * f + 2.402293054379790e-1f;
  p = p * f + 6.931470444493272e-1f;
  p = p * f + 1.0f;
  IV e = (__builtin_convertvector(fl, IV) + 127) << 23;
  V scale;
  std::memcpy(&scale, &e, sizeof scale);
  V r = p * scale;
  return x <= low ? V{} : r;
}

#if JAXRUNNER_F16_HALVES
inline F16 Exp(F16 x) { return {ExpLanes<F8, I8>(x.lo), ExpLanes<F8, I8>(x.hi)}; }
#else
inline F16 Exp(F16 x) { return ExpLanes<F16, I16>(x); }
#endif

// A software prefetch of one cache line into L2, which the compiler keeps: GCC 12 at -O3 deleted
// every __builtin_prefetch of the earlier page-ahead prefetch (it judged the helper pure and its
// result unused).
//
// Why L2 (prefetcht1) and not L1 (prefetcht0): an L1 prefetch holds one of the core's few L1
// miss buffers until its line arrives from DRAM, and once they are all taken the next prefetch
// instruction waits for one. In the attention kernel's profile the prefetch instructions took
// 18 % of the samples; prefetching into L2, which tracks many more misses, let the reads overlap:
// 64 float32 decodes over 30 layers' pools 75-79 -> 44-46 ms (10.8 -> 18 GB/s, what a standalone
// reader of random 12 KB chunks gets on both cores), bf16 batch-1 TPOT 22-24 -> 18-19 ms.
inline void PrefetchLine(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Into L1 (prefetcht0): for a few sequential streams read at the memory's rate, where L1's miss
// buffers are not the limit. The integer dot products of int4 weights (quant_dot.h) ran a
// batch-1 step about a tenth faster with it than with PrefetchLine (two alternating pairs).
inline void PrefetchLineL1(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

}  // namespace jaxrunner_cpu
