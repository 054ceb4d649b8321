// The problem one paged-attention call solves and its work items, shared by the AVX-512 kernel
// (paged_attention.cc) and the AMX-BF16 one (attention_amx.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace jaxrunner_cpu {

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim;
  int64_t num_pages, page_size, num_kv_heads, width, group;
  int64_t num_seqs;     // live sequences, clamped to [0, S]
  float sm_scale;
  float soft_cap;       // <= 0: none
  int64_t window;       // <= 0: none
  const int32_t* kv_lens;
  const int32_t* page_indices;
  const int32_t* cu;    // cu_q_lens
};

struct Item {
  int32_t seq, row0, rows;
  int64_t cost;         // rows * keys, for ordering
  int64_t part_lo = 0, part_hi = std::numeric_limits<int64_t>::max();  // keys of a part (SplitKeys)
};

// A part's unnormalised result for its keys: acc = sum of exp(s - max) v, total = sum of
// exp(s - max), per query vector.
struct Partial {
  std::vector<float> acc, max, total;  // [n, D], [n], [n]
};

// Key range [lo, hi) a tile of rows starting at position pos0 needs.
inline void KeyRange(const Problem& p, int64_t kv, int64_t pos0, int64_t rows, int64_t* lo,
                     int64_t* hi) {
  *hi = std::min(pos0 + rows, kv);
  *lo = p.window > 0 ? std::max<int64_t>(0, pos0 - (p.window - 1)) : 0;
}

}  // namespace jaxrunner_cpu
