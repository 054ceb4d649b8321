// Weight-only int4/int8 weights unpacked, a tile of columns at a time, into bfloat16 in the blocked
// layout oneDNN's AMX matmul reads (onednn_matmul.cc multiplies each tile as soon as it is written,
// while it is still in cache).
//
// The weights are a weight-only leaf as jaxrunner/models/quant.py describes it: [N, K] (each
// output's inputs contiguous), int4 two to a byte in GGUF's Q4_0 order (byte i of a run of 32
// inputs holds input i in its low nibble, input i + 16 in its high one) or int8, with a scale (and
// for int4 an offset) per output and group of inputs: w = scale * q (+ offset) in float32, then
// rounded to bf16, as quant.dequantize computes it. Or the same weight laid out as panels of
// sixteen outputs (kernels/quant_panels.py), which give the same tile bit for bit.
//
// The tile layout is oneDNN's `BA16a64b2a` for a [K, T] weight: blocks of 64 columns, each a run
// of blocks of 32 inputs; within one, 16 pairs of inputs, each pair's 64 columns holding the two
// inputs side by side (AMX's VNNI pairs). An output's 32 inputs come out of the weights as one row
// of 16 pairs, so 16 outputs at a time are transposed (16 x 16 units of 32 bits) into the block.
// Columns past N in the last block are zero (oneDNN reads its padding). A panel holds its sixteen
// outputs side by side already, four inputs to a 32-bit lane: there each pair of inputs is unpacked
// for the sixteen at once, and nothing is transposed.
//
// AVX-512 with BF16 (every CPU with AMX has it): compiled for those features whatever the build
// flags, and called only where the matmul table chose oneDNN (kernels/platform_support.py).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "transpose.h"

namespace jaxrunner_cpu {

#define JAXRUNNER_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,f16c")))
#define JAXRUNNER_INLINE_AVX512_BF16 JAXRUNNER_AVX512_BF16 __attribute__((always_inline)) inline

constexpr int64_t kTileColumns = 64;  // columns per block of the tile layout
constexpr int64_t kTileInputs = 32;   // inputs per block: 16 VNNI pairs

struct QuantView {
  const void* packed;   // uint8 [N, K/2] (int4) or int8 [N, K]; panels: uint8 [N/16, K/32 * (256 or 512)]
  const void* scales;   // [N, G], float16 or float32; panels: [N/16, G * 16]
  const void* offsets;  // like scales: int4 only
  int64_t n, k, groups;
  bool int4, f16;
  bool panels = false;  // laid out as panels (N a multiple of 16)
};

// Tile bytes: [K, width] bf16 with width padded to whole blocks of kTileColumns.
inline int64_t TileBytes(int64_t k, int64_t width) {
  return (width + kTileColumns - 1) / kTileColumns * kTileColumns * k * 2;
}

// Column `group` of rows [first, first + live) of a [N, G] float16 or float32 matrix, as float32
// (zeros past `live`), gathered at once: per output, the factor is then a broadcast from memory,
// which leaves the shuffle port to the unpacking and the transpose.
template <bool kF16>
JAXRUNNER_INLINE_AVX512_BF16 __m512 Gather16(const void* p, int64_t first, int64_t live, int64_t groups,
                                             int64_t group) {
  const __mmask16 rows = static_cast<__mmask16>((1u << live) - 1);
  const __m512i index = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int32_t>(first * groups + group)),
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int32_t>(groups))));
  if constexpr (!kF16) return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), rows, index, p, 4);
  // float16: the aligned 32-bit word holding each value (it never crosses a page), then its half
  const __m512i bytes = _mm512_slli_epi32(index, 1);
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows,
                                                    _mm512_andnot_si512(_mm512_set1_epi32(3), bytes), p, 1);
  const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(bytes, _mm512_set1_epi32(2)), 3);
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srlv_epi32(words, shift)));
}

// One run of 32 inputs of an output (its codes at `codes_of_run`) as 32 bf16 in input order (16
// VNNI pairs), from its group's scale and offset. int4: the group's sixteen values (scale * q + offset, q = 0..15) are
// computed once as bf16, and each code looks its value up (one permute for the 32 inputs).
template <bool kInt4>
JAXRUNNER_INLINE_AVX512_BF16 __m512i DequantizeRun(const void* codes_of_run, const float* scale, const float* offset) {
  // multiply, then add, each rounded, as quant.dequantize does (a fused multiply-add rounded some
  // weights to the neighbouring bf16)
  if constexpr (kInt4) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256bh table = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_mul_ps(codes, _mm512_set1_ps(*scale)),
                                                             _mm512_set1_ps(*offset)));
    const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(codes_of_run)), nibble = _mm_set1_epi8(15);
    const __m256i index = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(bytes, nibble)),
                                                  _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble), 1);
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(index), _mm512_castsi256_si512((__m256i)table));
  } else {
    const __m512 factor = _mm512_set1_ps(*scale);
    const int8_t* run = static_cast<const int8_t*>(codes_of_run);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + 16))));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, factor), _mm512_mul_ps(lo, factor));
  }
}

template <bool kInt4, bool kF16>
JAXRUNNER_AVX512_BF16 void DequantizeBlocks(const QuantView& w, int64_t n0, int64_t width, uint16_t* tile) {
  constexpr int64_t kRunBytes = kInt4 ? kTileInputs / 2 : kTileInputs;
  const int64_t runs = w.k / kTileInputs, blocks = (width + kTileColumns - 1) / kTileColumns;
  const int64_t row_bytes = runs * kRunBytes;
  const uint8_t* codes = static_cast<const uint8_t*>(w.packed);
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t sub = 0; sub < kTileColumns / 16; ++sub) {
      const int64_t first = n0 + block * kTileColumns + sub * 16;  // 16 outputs at a time
      const int64_t live = std::min<int64_t>(16, std::max<int64_t>(0, n0 + width - first));
      uint32_t* out = reinterpret_cast<uint32_t*>(tile) + block * runs * (kTileColumns * kTileInputs / 2) + sub * 16;
      alignas(64) float scales[16], offsets[16];
      for (int64_t kb = 0, group = -1; kb < runs; ++kb, out += kTileColumns * kTileInputs / 2) {
        if (kb * kTileInputs / (w.k / w.groups) != group) {  // groups are whole runs
          group = kb * kTileInputs / (w.k / w.groups);
          _mm512_store_ps(scales, Gather16<kF16>(w.scales, first, live, w.groups, group));
          if constexpr (kInt4) _mm512_store_ps(offsets, Gather16<kF16>(w.offsets, first, live, w.groups, group));
        }
        __m512i r[16];
#pragma GCC unroll 16
        for (int64_t i = 0; i < 16; ++i)
          r[i] = i < live ? DequantizeRun<kInt4>(codes + (first + i) * row_bytes + kb * kRunBytes, scales + i,
                                                 offsets + i)
                          : _mm512_setzero_si512();
        Transpose16(r);
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) _mm512_store_si512(out + j * kTileColumns, r[j]);
      }
    }
  }
}

// Sixteen values of one scale group, a lane each, from a panel's [G * 16] row of them.
template <bool kF16>
JAXRUNNER_INLINE_AVX512_BF16 __m512 PanelLanes(const void* p, int64_t index) {
  if constexpr (kF16) return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p) + index));
  return _mm512_loadu_ps(static_cast<const float*>(p) + 16 * index);
}

// Input pairs (a, b) of sixteen outputs, float32 in lanes, as sixteen bf16 pairs: a low, b high.
JAXRUNNER_INLINE_AVX512_BF16 __m512i Bf16Pairs(__m512 a, __m512 b) {
  const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004,
                                               0x00150005, 0x00160006, 0x00170007, 0x00180008, 0x00190009,
                                               0x001a000a, 0x001b000b, 0x001c000c, 0x001d000d, 0x001e000e,
                                               0x001f000f);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Codes q of sixteen outputs, int32 in lanes, as weights: multiply, then add, each rounded, as
// quant.dequantize does.
template <bool kInt4>
JAXRUNNER_INLINE_AVX512_BF16 __m512 PanelValues(__m512i q, __m512 scale, __m512 offset) {
  const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale);
  return kInt4 ? _mm512_add_ps(w, offset) : w;
}

// Pair `pair` of the tile block from the codes of its two inputs.
template <bool kInt4>
JAXRUNNER_INLINE_AVX512_BF16 void StorePair(uint32_t* out, int pair, __m512i q0, __m512i q1, __m512 scale,
                                            __m512 offset) {
  _mm512_store_si512(out + pair * kTileColumns,
                     Bf16Pairs(PanelValues<kInt4>(q0, scale, offset), PanelValues<kInt4>(q1, scale, offset)));
}

// Int4 codes at bit `shift` of each lane.
JAXRUNNER_INLINE_AVX512_BF16 __m512i Nibbles(__m512i v, int shift) {
  return _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(15));
}

// Signed int8 codes in byte `byte` of each lane.
JAXRUNNER_INLINE_AVX512_BF16 __m512i SignedBytes(__m512i v, int byte) {
  return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * byte), 24);
}

// One run of a panel (16 outputs x 32 inputs) as its 16 pairs of the tile block, `out` + j *
// kTileColumns for pair j. int4: vector q's lane o holds bytes 4q .. 4q + 3 of output o's run, each
// input 4q + b in its low nibble and 4q + b + 16 in its high one; int8: vector q holds inputs
// 4q .. 4q + 3, plus 128.
template <bool kInt4>
JAXRUNNER_INLINE_AVX512_BF16 void DequantizePanelRun(const __m512i* run, __m512 scale, __m512 offset, uint32_t* out) {
  if constexpr (kInt4) {
    for (int q = 0; q < 4; ++q) {
      const __m512i v = _mm512_loadu_si512(run + q);
      StorePair<true>(out, 2 * q, Nibbles(v, 0), Nibbles(v, 8), scale, offset);
      StorePair<true>(out, 2 * q + 1, Nibbles(v, 16), Nibbles(v, 24), scale, offset);
      StorePair<true>(out, 8 + 2 * q, Nibbles(v, 4), Nibbles(v, 12), scale, offset);
      StorePair<true>(out, 9 + 2 * q, Nibbles(v, 20), Nibbles(v, 28), scale, offset);
    }
  } else {
    for (int q = 0; q < 8; ++q) {
      const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(run + q), _mm512_set1_epi32(int32_t(0x80808080u)));
      StorePair<false>(out, 2 * q, SignedBytes(v, 0), SignedBytes(v, 1), scale, offset);
      StorePair<false>(out, 2 * q + 1, SignedBytes(v, 2), SignedBytes(v, 3), scale, offset);
    }
  }
}

// How far ahead of the run being unpacked a panel's codes are prefetched (into L2). Without it the
// unpacking waited on each line of codes: half of its samples sat on the load, and an int8 1B-model
// product of 64 rows spent more of its time unpacking than multiplying.
constexpr int64_t kPanelPrefetchBytes = 4096;

template <bool kInt4, bool kF16>
JAXRUNNER_AVX512_BF16 void DequantizePanelBlocks(const QuantView& w, int64_t n0, int64_t width, uint16_t* tile) {
  constexpr int64_t kRunBytes = kInt4 ? 256 : 512;  // a panel's run: sixteen outputs' codes of 32 inputs
  const int64_t runs = w.k / kTileInputs, blocks = (width + kTileColumns - 1) / kTileColumns;
  const int64_t runs_per_group = runs / w.groups;
  for (int64_t block = 0; block < blocks; ++block) {
    for (int64_t sub = 0; sub < kTileColumns / 16; ++sub) {
      const int64_t first = n0 + block * kTileColumns + sub * 16, panel = first / 16;
      uint32_t* out = reinterpret_cast<uint32_t*>(tile) + block * runs * (kTileColumns * kTileInputs / 2) + sub * 16;
      if (first >= n0 + width) {  // past N: zeros
        for (int64_t pair = 0; pair < runs * kTileInputs / 2; ++pair)
          _mm512_store_si512(out + pair * kTileColumns, _mm512_setzero_si512());
        continue;
      }
      const __m512i* codes = reinterpret_cast<const __m512i*>(static_cast<const uint8_t*>(w.packed) +
                                                              panel * runs * kRunBytes);
      __m512 scale = _mm512_setzero_ps(), offset = _mm512_setzero_ps();
      for (int64_t kb = 0; kb < runs; ++kb, out += kTileColumns * kTileInputs / 2) {
        // the panels lie one after another, so past this panel's end come the next one's codes
        const char* ahead = reinterpret_cast<const char*>(codes + kb * kRunBytes / 64) + kPanelPrefetchBytes;
        for (int64_t at = 0; at < kRunBytes; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T1);
        if (kb % runs_per_group == 0) {  // groups are whole runs
          const int64_t index = panel * w.groups + kb / runs_per_group;
          scale = PanelLanes<kF16>(w.scales, index);
          if constexpr (kInt4) offset = PanelLanes<kF16>(w.offsets, index);
        }
        DequantizePanelRun<kInt4>(codes + kb * kRunBytes / 64, scale, offset, out);
      }
    }
  }
}

// Columns [n0, n0 + width) of the weight, all K inputs (K a multiple of 32), into `tile`
// (TileBytes(k, width) bytes, 64-byte aligned) in the layout above.
inline void DequantizeTile(const QuantView& w, int64_t n0, int64_t width, uint16_t* tile) {
  if (w.panels) {
    if (w.int4) {
      w.f16 ? DequantizePanelBlocks<true, true>(w, n0, width, tile) : DequantizePanelBlocks<true, false>(w, n0, width, tile);
    } else {
      w.f16 ? DequantizePanelBlocks<false, true>(w, n0, width, tile) : DequantizePanelBlocks<false, false>(w, n0, width, tile);
    }
  } else if (w.int4) {
    w.f16 ? DequantizeBlocks<true, true>(w, n0, width, tile) : DequantizeBlocks<true, false>(w, n0, width, tile);
  } else {
    w.f16 ? DequantizeBlocks<false, true>(w, n0, width, tile) : DequantizeBlocks<false, false>(w, n0, width, tile);
  }
}

}  // namespace jaxrunner_cpu
