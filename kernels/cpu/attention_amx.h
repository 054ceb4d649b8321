// Paged attention on AMX-BF16 tiles, for paged_attention.cc: bfloat16 queries and pages, head
// sizes a multiple of 32, pages a multiple of 16 rows, no soft cap.
//
// Why: the AVX-512 kernel widens every K and V value to float32 and multiplies with FMAs, about
// 110 cycles of a core per key row at SmolLM2's nine query heads (docs/performance.md, "CPU model
// 207"); one tdpbf16ps multiplies 16 x 16 x 32 bf16 values.
//
// One work item (a sequence's tile of query rows, all heads), as four passes over its keys from
// `c0` (the first key rounded down to 16, so that 16 keys are 16 rows of one page):
//  * Columns. The item's query vectors grouped by kv head in blocks of 16 columns: several kv
//    heads share a block where their vectors fit (a chunk's last, shorter item), and a head with
//    more than 16 vectors takes whole blocks of its own.
//  * Scores, key-major: C [16 keys][16 columns] = sum over the block's kv heads h of
//    K_h [16 keys][32 dims] . Q_h^T, where Q_h^T holds head h's columns and zeros in the others;
//    K's tile is read straight out of the page at its row stride, Q^T in AMX's pairs form (a pair
//    of dims in each 32-bit lane).
//  * Softmax per column, sixteen columns a vector: the raw dots' maximum, then exp((dot - max) *
//    scale), rounded to bf16 as P @ V multiplies it; the sum is taken of the rounded values, so
//    the weights of a row add up to one exactly as multiplied.
//  * P @ V: C [16 columns][16 dims] += P_h [16 columns][32 keys] . V_h [32 keys][16 dims] over
//    the block's kv heads, P_h transposed from the key-major probabilities with the rows of other
//    heads' columns zero, V's rows interleaved in pairs once per item.
//    Keys outside the item's range get probability zero and zero V rows (rows past the sequence's
//    length may hold anything).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define JAXRUNNER_AMX_ATTENTION 1

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "attention_problem.h"
#include "transpose.h"
#include "vec.h"

namespace jaxrunner_cpu {

// Whether the tile kernel takes this problem (the caller checks the dtypes).
inline bool AmxAttentionFits(const Problem& p) {
  return AmxGranted() && p.page_size % 16 == 0 && p.head_dim % 32 == 0 && p.head_dim <= 256 &&
         p.soft_cap <= 0 && p.sm_scale > 0;
}

// Query rows per work item: one block of 16 columns per kv head when the group fits, and at least
// two (an item of one row is a decode's, which paged_attention.cc keeps on AVX-512).
inline int64_t AmxRowTile(const Problem& p) { return std::max<int64_t>(2, 16 / p.group); }

// Per-thread buffers of one work item.
struct AmxScratch {
  std::vector<uint32_t> q_t;         // [blocks, heads a block, steps, 16 pairs, 16 columns]: Q_h^T
  std::vector<float> s;              // [keys padded to 32, columns]: dots, then probabilities
  std::vector<uint32_t> v_t;         // [key blocks of 32, Hkv, D / 16, 16 pairs, 16 dims]
  std::vector<uint32_t> p_t;         // [heads a block, key blocks of 32, 16 columns, 16 pairs]: P_h
  std::vector<float> o;              // [16 columns, D]: one block's P @ V
  std::vector<int32_t> first, last;  // [columns]: each column's keys, relative to c0
  std::vector<float> total;          // [columns]: the sum of the probabilities
};

class AmxAttention {
 public:
  AmxAttention(const Problem& p, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out)
      : p_(p), q_(q), k_(k), v_(v), out_(out) {}

  void Run(const Item& it, AmxScratch& sc) const {
    const Shape sh = MakeShape(it);
    Ranges(it, sh, sc);
    sc.total.assign(sh.cols, 0.0f);
    if (sh.keys == 0) {  // nothing to attend to: zeros
      sc.o.assign(16 * p_.head_dim, 0.0f);
      for (int64_t b = 0; b < sh.blocks; ++b) Write(it, sh, b, sc);
      return;
    }
    sc.o.resize(16 * p_.head_dim);
    ConfigureTiles();
    LoadQueries(it, sh, sc);
    Scores(it, sh, sc);
    for (int64_t b = 0; b < sh.blocks; ++b) Softmax(sh, b, sc);
    ValueTiles(it, sh, sc);
    for (int64_t b = 0; b < sh.blocks; ++b) {
      Values(sh, b, sc);
      Write(it, sh, b, sc);
    }
    _tile_release();
  }

 private:
  struct Shape {
    int64_t per_head;          // query vectors of one kv head: rows * G
    int64_t heads_per_block;   // kv heads sharing a block (1 when a head takes several)
    int64_t blocks_per_head;   // blocks of one kv head (1 when heads share)
    int64_t blocks, cols;      // columns: blocks * 16
    int64_t pos0, lo, hi, c0, keys, chunks, key_blocks;
  };

  Shape MakeShape(const Item& it) const {
    Shape sh;
    const int64_t Hkv = p_.num_kv_heads;
    sh.per_head = int64_t(it.rows) * p_.group;
    sh.heads_per_block = sh.per_head <= 16 ? std::min<int64_t>(Hkv, 16 / sh.per_head) : 1;
    sh.blocks_per_head = (sh.per_head + 15) / 16;
    sh.blocks = sh.per_head <= 16 ? (Hkv + sh.heads_per_block - 1) / sh.heads_per_block : sh.blocks_per_head * Hkv;
    sh.cols = sh.blocks * 16;
    const int64_t q_len = p_.cu[it.seq + 1] - p_.cu[it.seq];
    const int64_t kv = std::clamp<int64_t>(p_.kv_lens[it.seq], 0, p_.width * p_.page_size);
    sh.pos0 = kv - q_len + it.row0;
    KeyRange(p_, kv, sh.pos0, it.rows, &sh.lo, &sh.hi);
    sh.c0 = sh.lo - sh.lo % 16;
    sh.keys = sh.hi > sh.lo ? sh.hi - sh.c0 : 0;
    sh.chunks = (sh.keys + 15) / 16;
    sh.key_blocks = (sh.keys + 31) / 32;
    return sh;
  }

  // The kv heads of block b: [first, first + count).
  void Heads(const Shape& sh, int64_t b, int64_t* first, int64_t* count) const {
    if (sh.per_head > 16) {
      *first = b / sh.blocks_per_head;
      *count = 1;
      return;
    }
    *first = b * sh.heads_per_block;
    *count = std::min(sh.heads_per_block, p_.num_kv_heads - *first);
  }

  // Column c of block b: the query vector's row r and query head (h * G + g), and in *slot which
  // of the block's kv heads it belongs to; -1 for padding.
  int64_t Vector(const Shape& sh, int64_t b, int64_t c, int64_t* row, int64_t* slot) const {
    int64_t h, j;
    if (sh.per_head > 16) {
      h = b / sh.blocks_per_head, j = (b % sh.blocks_per_head) * 16 + c, *slot = 0;
      if (j >= sh.per_head) return -1;
    } else {
      *slot = c / sh.per_head, h = b * sh.heads_per_block + *slot, j = c % sh.per_head;
      if (*slot >= sh.heads_per_block || h >= p_.num_kv_heads) return -1;
    }
    *row = j / p_.group;
    return h * p_.group + j % p_.group;
  }

  // Each column's keys relative to c0: causal (up to its row's position) and, with a window, the
  // last `window`.
  void Ranges(const Item& it, const Shape& sh, AmxScratch& sc) const {
    sc.first.assign(sh.cols, 0);
    sc.last.assign(sh.cols, 0);
    for (int64_t b = 0; b < sh.blocks; ++b)
      for (int64_t c = 0; c < 16; ++c) {
        int64_t r, slot;
        if (Vector(sh, b, c, &r, &slot) < 0 || sh.keys == 0) continue;
        const int64_t pos = sh.pos0 + r;
        const int64_t a = p_.window > 0 ? std::max(sh.lo, pos - (p_.window - 1)) : sh.lo;
        const int64_t e = std::max(a, std::min(pos + 1, sh.hi));
        sc.first[b * 16 + c] = int32_t(a - sh.c0);
        sc.last[b * 16 + c] = int32_t(e - sh.c0);
      }
  }

  int64_t Steps() const { return p_.head_dim / 32; }

  // Q_h^T tiles: tile (b, slot, s) row i, column c = dims 32s + 2i and 32s + 2i + 1 of column c's
  // vector where it belongs to the block's kv head `slot`, zeros elsewhere.
  void LoadQueries(const Item& it, const Shape& sh, AmxScratch& sc) const {
    const int64_t steps = Steps(), width = p_.num_q_heads * p_.head_dim, hpb = sh.heads_per_block;
    sc.q_t.assign(sh.blocks * hpb * steps * 256, 0);
    const uint16_t* rows = q_ + (p_.cu[it.seq] + it.row0) * width;
    for (int64_t b = 0; b < sh.blocks; ++b)
      for (int64_t c = 0; c < 16; ++c) {
        int64_t r, slot;
        const int64_t head = Vector(sh, b, c, &r, &slot);
        if (head < 0) continue;
        const uint16_t* src = rows + r * width + head * p_.head_dim;
        uint32_t* tiles = sc.q_t.data() + (b * hpb + slot) * steps * 256;
        for (int64_t d = 0; d < p_.head_dim; d += 2) {
          uint32_t pair;
          std::memcpy(&pair, src + d, sizeof pair);
          tiles[(d / 32 * 16 + d % 32 / 2) * 16 + c] = pair;
        }
      }
  }

  // Element offset of key `pos`'s row (all kv heads) in a pool.
  int64_t RowOffset(const Item& it, int64_t pos) const {
    const int64_t ps = p_.page_size;
    const int64_t page = std::clamp<int64_t>(p_.page_indices[it.seq * p_.width + pos / ps], 0, p_.num_pages - 1);
    return (page * ps + pos % ps) * p_.num_kv_heads * p_.head_dim;
  }

  // 16 rows from key `pos` into L2, ahead of their use: pages sit where the hardware prefetcher
  // cannot follow.
  void Prefetch(const uint16_t* pool, const Item& it, int64_t pos) const {
    const char* at = reinterpret_cast<const char*>(pool + RowOffset(it, pos));
    const int64_t bytes = 16 * p_.num_kv_heads * p_.head_dim * int64_t(sizeof(uint16_t));
    for (int64_t l = 0; l < bytes; l += 64) PrefetchLine(at + l);
  }

  // sc.s[t, column] = q . k_t for the 16 * chunks keys from c0.
  void Scores(const Item& it, const Shape& sh, AmxScratch& sc) const {
    const int64_t steps = Steps(), stride = p_.num_kv_heads * p_.head_dim * int64_t(sizeof(uint16_t));
    sc.s.resize(sh.key_blocks * 32 * sh.cols);  // rows past the chunks: masked by Softmax
    for (int64_t chunk = 0; chunk < sh.chunks; ++chunk) {
      const int64_t pos = sh.c0 + 16 * chunk;
      if (chunk + 1 < sh.chunks) Prefetch(k_, it, pos + 16);
      const uint16_t* rows = k_ + RowOffset(it, pos);
      for (int64_t b = 0; b < sh.blocks; ++b) {
        int64_t h0, heads;
        Heads(sh, b, &h0, &heads);
        _tile_zero(0);
        for (int64_t slot = 0; slot < heads; ++slot)
          for (int64_t s = 0; s < steps; ++s) {
            _tile_loadd(1, rows + (h0 + slot) * p_.head_dim + 32 * s, stride);
            _tile_loadd(2, sc.q_t.data() + ((b * sh.heads_per_block + slot) * steps + s) * 256, 64);
            _tile_dpbf16ps(0, 1, 2);
          }
        _tile_stored(0, sc.s.data() + 16 * chunk * sh.cols + 16 * b, sh.cols * int64_t(sizeof(float)));
      }
    }
  }

  // Block b's dots -> probabilities rounded to bf16 (zero outside each column's keys), and each
  // column's sum of them.
  void Softmax(const Shape& sh, int64_t b, AmxScratch& sc) const {
    const __m512i first = _mm512_loadu_si512(sc.first.data() + 16 * b), last = _mm512_loadu_si512(sc.last.data() + 16 * b);
    const int64_t begin = _mm512_reduce_min_epi32(first), end = _mm512_reduce_max_epi32(last);
    float* s = sc.s.data() + 16 * b;
    const auto in_range = [&](int64_t t) {
      const __m512i at = _mm512_set1_epi32(int32_t(t));
      return _mm512_mask_cmplt_epi32_mask(_mm512_cmpge_epi32_mask(at, first), at, last);
    };
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = begin; t < end; ++t)  // a NaN dot is passed over, as std::max(m, dot) does
      m = _mm512_mask_max_ps(m, in_range(t), _mm512_loadu_ps(s + t * sh.cols), m);
    const __m512 scale = _mm512_set1_ps(p_.sm_scale);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < sh.key_blocks * 32; ++t) {
      float* row = s + t * sh.cols;
      const __mmask16 in = t >= begin && t < end ? in_range(t) : 0;
      const __m512 e = (__m512)Exp((F16)_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(row), m), scale));
      const __m512i bits = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(in, e)));
      const __m512 p = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
      sum = _mm512_add_ps(sum, p);
      _mm512_storeu_ps(row, p);
    }
    _mm512_storeu_ps(sc.total.data() + 16 * b, sum);
  }

  // V's rows from c0 in pairs (the B tiles of P @ V), zeros outside [lo, hi).
  void ValueTiles(const Item& it, const Shape& sh, AmxScratch& sc) const {
    const int64_t Hkv = p_.num_kv_heads, D = p_.head_dim, tiles = D / 16;
    sc.v_t.resize(sh.key_blocks * Hkv * tiles * 256);
    alignas(64) static const uint16_t kZeros[256] = {};
    __m512i first_half, second_half;  // interleave dims 0..15 and 16..31 of two rows
    {
      alignas(64) uint16_t a[32], c[32];
      for (int i = 0; i < 16; ++i) {
        a[2 * i] = uint16_t(i), a[2 * i + 1] = uint16_t(32 + i);
        c[2 * i] = uint16_t(16 + i), c[2 * i + 1] = uint16_t(48 + i);
      }
      first_half = _mm512_load_si512(a);
      second_half = _mm512_load_si512(c);
    }
    for (int64_t kb = 0; kb < sh.key_blocks; ++kb)
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t pos = sh.c0 + 32 * kb + 2 * j;
        if (j % 8 == 0 && pos + 16 < sh.hi) Prefetch(v_, it, pos + 16);
        const bool in0 = pos >= sh.lo && pos < sh.hi, in1 = pos + 1 >= sh.lo && pos + 1 < sh.hi;
        const uint16_t* r0 = in0 ? v_ + RowOffset(it, pos) : kZeros;
        const uint16_t* r1 = in1 ? v_ + RowOffset(it, pos + 1) : kZeros;
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t d = 0; d < D; d += 32) {
            const int64_t at = (in0 ? h * D + d : 0), bt = (in1 ? h * D + d : 0);
            const __m512i x0 = _mm512_loadu_si512(r0 + at), x1 = _mm512_loadu_si512(r1 + bt);
            uint32_t* dst = sc.v_t.data() + ((kb * Hkv + h) * tiles + d / 16) * 256 + j * 16;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x0, first_half, x1));
            _mm512_storeu_si512(dst + 256, _mm512_permutex2var_epi16(x0, second_half, x1));
          }
      }
  }

  // Block b's P_h as A tiles: tile (slot, kb) row c holds column c's probabilities of key block
  // kb's 32 keys where column c belongs to the block's kv head `slot`, zeros elsewhere.
  void ProbabilityTiles(const Shape& sh, int64_t b, AmxScratch& sc) const {
    int64_t h0, heads;
    Heads(sh, b, &h0, &heads);
    int64_t slot_of[16];
    for (int64_t c = 0; c < 16; ++c) {
      int64_t r;
      if (Vector(sh, b, c, &r, &slot_of[c]) < 0) slot_of[c] = -1;
    }
    sc.p_t.resize(heads * sh.key_blocks * 256);
    alignas(64) uint16_t order[32];
    for (int i = 0; i < 16; ++i) order[2 * i] = uint16_t(i), order[2 * i + 1] = uint16_t(16 + i);
    const __m512i interleave = _mm512_load_si512(order);
    const float* s = sc.s.data() + 16 * b;
    for (int64_t kb = 0; kb < sh.key_blocks; ++kb) {
      __m512i pairs[16];  // pairs[j] lane c: column c's probabilities of keys 2j, 2j + 1
      for (int j = 0; j < 16; ++j) {
        const float* even = s + (32 * kb + 2 * j) * sh.cols;
        const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(even + sh.cols), _mm512_loadu_ps(even));
        pairs[j] = _mm512_permutexvar_epi16(interleave, (__m512i)both);
      }
      Transpose16(pairs);
      for (int64_t slot = 0; slot < heads; ++slot)
        for (int c = 0; c < 16; ++c)
          _mm512_storeu_si512(sc.p_t.data() + (slot * sh.key_blocks + kb) * 256 + c * 16,
                              slot_of[c] == slot ? pairs[c] : _mm512_setzero_si512());
    }
  }

  // sc.o [16 columns][D] = block b's P @ V_h.
  void Values(const Shape& sh, int64_t b, AmxScratch& sc) const {
    ProbabilityTiles(sh, b, sc);
    const int64_t Hkv = p_.num_kv_heads, D = p_.head_dim, tiles = D / 16;
    int64_t h0, heads;
    Heads(sh, b, &h0, &heads);
    for (int64_t t0 = 0; t0 < tiles; t0 += 4) {
      const int64_t count = std::min<int64_t>(4, tiles - t0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < sh.key_blocks; ++kb)
        for (int64_t slot = 0; slot < heads; ++slot) {
          _tile_loadd(4, sc.p_t.data() + (slot * sh.key_blocks + kb) * 256, 64);
          const uint32_t* v = sc.v_t.data() + ((kb * Hkv + h0 + slot) * tiles + t0) * 256;
          _tile_loadd(5, v, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (count > 1) {
            _tile_loadd(6, v + 256, 64);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (count > 2) {
            _tile_loadd(7, v + 512, 64);
            _tile_dpbf16ps(2, 4, 7);
          }
          if (count > 3) {
            _tile_loadd(5, v + 768, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
        }
      const int64_t stride = D * int64_t(sizeof(float));
      float* o = sc.o.data() + t0 * 16;
      _tile_stored(0, o, stride);
      if (count > 1) _tile_stored(1, o + 16, stride);
      if (count > 2) _tile_stored(2, o + 32, stride);
      if (count > 3) _tile_stored(3, o + 48, stride);
    }
  }

  // Block b's columns normalised into out.
  void Write(const Item& it, const Shape& sh, int64_t b, const AmxScratch& sc) const {
    const int64_t D = p_.head_dim, Hq = p_.num_q_heads;
    for (int64_t c = 0; c < 16; ++c) {
      int64_t r, slot;
      const int64_t head = Vector(sh, b, c, &r, &slot);
      if (head < 0) continue;
      const float total = sc.total[16 * b + c], *o = sc.o.data() + c * D;
      uint16_t* dst = out_ + ((p_.cu[it.seq] + it.row0 + r) * Hq + head) * D;
      const F16 scale = Splat(total > 0.0f || std::isnan(total) ? 1.0f / total : 0.0f);
      for (int64_t d = 0; d < D; d += kLanes) Store(Load(o + d) * scale, dst + d);
    }
  }

  Problem p_;
  const uint16_t* q_;
  const uint16_t* k_;
  const uint16_t* v_;
  uint16_t* out_;
};

}  // namespace jaxrunner_cpu

#endif
