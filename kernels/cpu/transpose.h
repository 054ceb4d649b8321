// Square transposes of 32-bit units in registers, for packing weights into panels and tiles:
// eight by eight in AVX2 registers, sixteen by sixteen in AVX-512 ones.
//
// Each is compiled for its instruction set whatever the build flags (a target attribute), so one
// header serves the native kernels built with -march=native and oneDNN's glue built without it;
// only a caller that runs on such a CPU may call them.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

namespace jaxrunner_cpu {

#define JAXRUNNER_INLINE_AVX2 __attribute__((target("avx2"), always_inline)) inline
#define JAXRUNNER_INLINE_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// Dwords j of the eight vectors d[o] gathered into out[j] (dword o from d[o]): an 8 x 8 transpose.
JAXRUNNER_INLINE_AVX2 void TransposeDwords(const __m256i d[8], __m256i out[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(d[2 * i], d[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(d[2 * i], d[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // h: outputs 0..3, then 4..7
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);      // quads 0 | 4
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);      // 1 | 5
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);  // 2 | 6
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);  // 3 | 7
  }
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    out[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// 16 rows of 16 32-bit units, transposed in registers.
JAXRUNNER_INLINE_AVX512 void Transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
  }
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // u[4q + c], lane L: unit 4L + c of rows 4q..4q+3
    u[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {  // gather lane L of u[c], u[4 + c], u[8 + c], u[12 + c] into row 4L + c
    const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(a, e, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xdd);
  }
}

}  // namespace jaxrunner_cpu

#endif
