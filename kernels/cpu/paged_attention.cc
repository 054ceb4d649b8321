// Ragged paged attention for XLA:CPU, as an XLA FFI custom call.
//
// Why a native kernel on CPU: XLA cannot read a page table inside a dot, so the XLA path
// (kernels/xla.py) first gathers every sequence's pages into a temporary and then reads that
// back -- about three passes over K/V, and decode attention is bound by memory bandwidth. Here
// each work item reads its sequence's K/V rows straight out of the pool, once.
//
// Semantics are those of kernels/reference.py: q [T, Hq, D]; k/v pages [P, page_size, Hkv, D];
// kv_lens [S]; page_indices [S, W]; cu_q_lens [S+1]; num_seqs [1]. Query row i of sequence s
// sits at position kv_lens[s] - q_len(s) + i and attends to keys at positions <= its own (and
// inside the sliding window when one is set). Rows with nothing to attend to and padding rows
// (past cu_q_lens[num_seqs]) come out as zeros. Scores and softmax are float32. Queries are
// float32 or bfloat16; pages float32, bfloat16 or 8-bit floats (fp8.h), each value widened exactly
// to float32 as it is read.
//
// Work item: (sequence, tile of query rows), all heads: each page is read as one contiguous block
// and the G = Hq/Hkv query heads of a kv head share every K/V row loaded (GQA without repeating
// K/V). Pages are looked up once per page, not per row, and rows are prefetched a few ahead. Scores
// for all keys the tile needs come first (four keys per shuffle-and-add tree), then an exact
// softmax per row (vectorised exp), then P @ V over tiles of V rows held in L1 with the
// accumulators in registers. Items, most expensive first, are spread over XLA's intra-op thread
// pool; the calling thread works too, so nothing waits on a task that never gets a thread. A lone
// decode row (batch 1) splits its keys in two parts instead, merged by their softmax sums
// (RunSplit): one item would keep one core idle.
//
// On a CPU with AMX, bf16 queries and pages take the query rows of prefill chunks to AMX-BF16
// tiles instead (attention_amx.h, MixedAttention below); decode rows stay here.
//
// Measured (2-core AMD EPYC, AVX-512, SmolLM2 heads 9/3 x 64, page 16, f32, min of 40; XLA path
// in brackets): 64 decodes of kv 150..400 2.0 ms [5.5]; 4 prefills of 256 tokens 3.2 ms [13];
// 60 decodes + 4 chunks of 128 tokens 5.3 ms [40]. Decode's floor at ~20 GB/s is ~1.4 ms.
//
// The file also holds the KV page write (JaxrunnerCpuWriteKv, at the end).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "attention_amx.h"
#include "attention_problem.h"
#include "fp8.h"
#include "helper_thread.h"
#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr int64_t kQueryVectors = 64;  // query rows x heads per work item, at most
constexpr int64_t kValueTileBytes = 16 << 10;  // V rows per P @ V tile: about 16 KB, half an L1
constexpr int kMaxHeadDim = 256;
constexpr int kMaxChunks = kMaxHeadDim / kLanes;
constexpr int64_t kPrefetchBytes = 6 << 10;  // K/V bytes ahead of the row being read

// max(s[a, b)), b > a, as std::max takes it in order (a NaN after the first element is passed over),
// kLanes running maxima at a time: one chain of scalar maxima, a few cycles per key, took about a
// tenth of a decode item's time.
inline float RangeMax(const float* s, int64_t a, int64_t b) {
  float lanes[kLanes];
  for (int l = 0; l < kLanes; ++l) lanes[l] = s[a];
  int64_t t = a + 1;
  for (; t + kLanes <= b; t += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], s[t + l]);
  float m = lanes[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, lanes[l]);
  for (; t < b; ++t) m = std::max(m, s[t]);
  return m;
}

// Per-thread buffers of one work item. Query vector i = r * Hq + (query head) for tile row r.
struct Scratch {
  std::vector<F16> q;        // [n, chunks] scaled queries
  std::vector<F16> acc;      // [n, chunks] P @ V accumulators
  std::vector<F16> tile;     // [kValueTile, Hkv, chunks] V rows
  std::vector<float> scores; // [n, keys]: scores, then probabilities
  std::vector<int64_t> first, last;  // per query vector: its keys [first, last) relative to lo
  std::vector<float> inv_sum;
  std::vector<float> max, total;  // per query vector: the largest score, the sum of exp(s - max)
  std::vector<int64_t> row_offset;  // [keys] where each K/V row sits in a pool
};

// kChunks: head_dim / 16 when known at compile time (64 and 128: the K/V rows and accumulators
// then live in registers), 0 for any other multiple of 16.
template <typename QT, typename KT, int kChunks>
class Attention {
 public:
  Attention(const Problem& p, const QT* q, const KT* k, const KT* v, QT* out)
      : p_(p), q_(q), k_(k), v_(v), out_(out), chunks_(kChunks ? kChunks : p.head_dim / kLanes) {}

  // All kv heads of one tile of query rows: every page is then read as one contiguous block
  // (page_size x Hkv x D), which the hardware prefetcher streams; per-head items read
  // 256-byte pieces at a stride and measured slower.
  void Run(const Item& it, Scratch& sc, Partial* partial = nullptr) const {
    const int64_t n = int64_t(it.rows) * p_.num_q_heads, chunks = Chunks();
    const int64_t q_start = p_.cu[it.seq];
    const int64_t q_len = p_.cu[it.seq + 1] - q_start;
    const int64_t kv = std::clamp<int64_t>(p_.kv_lens[it.seq], 0, p_.width * p_.page_size);
    const int64_t pos0 = kv - q_len + it.row0;
    int64_t lo, hi;
    KeyRange(p_, kv, pos0, it.rows, &lo, &hi);
    lo = std::max(lo, it.part_lo);
    hi = std::min(hi, it.part_hi);
    const int64_t keys = std::max<int64_t>(hi - lo, 0);
    sc.q.resize(n * chunks);
    sc.acc.assign(n * chunks, F16{});
    sc.tile.resize(ValueTile() * p_.num_kv_heads * chunks);
    sc.scores.resize(n * keys + kLanes);
    sc.first.resize(n);
    sc.last.resize(n);
    sc.inv_sum.assign(n, 0.0f);
    sc.max.assign(n, -std::numeric_limits<float>::infinity());
    sc.total.assign(n, 0.0f);
    LoadQueries(it, q_start, sc.q.data());
    Ranges(it, pos0, lo, hi, sc);
    if (keys > 0) {
      RowOffsets(it, lo, hi, sc);
      Scores(it, lo, hi, sc);
      Softmax(n, keys, sc);
      Values(it, lo, hi, sc);
    }
    if (partial != nullptr) return KeepPartial(n, sc, partial);
    Store(it, q_start, sc);
  }

 private:
  int64_t ValueTile() const {
    const int64_t row_bytes = p_.num_kv_heads * p_.head_dim * int64_t(sizeof(float));
    return std::clamp<int64_t>(kValueTileBytes / row_bytes, 4, 64);
  }

  // Scratch::row_offset[j] = element offset, in a K or V pool, of key row lo + j for j in
  // [0, hi - lo): one page lookup per page, shared by the K and V passes.
  void RowOffsets(const Item& it, int64_t lo, int64_t hi, Scratch& sc) const {
    const int64_t ps = p_.page_size, row_stride = p_.num_kv_heads * p_.head_dim;
    const int32_t* table = p_.page_indices + it.seq * p_.width;
    sc.row_offset.resize(std::max<int64_t>(hi - lo, 0));
    for (int64_t t = lo; t < hi;) {
      const int64_t page = std::clamp<int64_t>(table[t / ps], 0, p_.num_pages - 1);
      const int64_t end = std::min(hi, t - t % ps + ps);
      for (; t < end; ++t) sc.row_offset[t - lo] = (page * ps + t % ps) * row_stride;
    }
  }

  // Calls visit(j, row) for j in [begin, end), row pointing at key row lo + j (all kv heads).
  // Pages sit at random places in the pool, where the hardware prefetcher cannot follow, so each
  // row visited prefetches (into L2) the row about kPrefetchBytes further on: 8 float32 rows or 16
  // bf16 rows of SmolLM2 (measured with 64 decodes: 16 bf16 rows 33 -> 27-31 ms, 4 rows slower).
  template <typename Visit>
  void ForEachRow(const KT* pool, const Scratch& sc, int64_t begin, int64_t end,
                  Visit&& visit) const {
    const int64_t* offset = sc.row_offset.data();
    const int64_t keys = int64_t(sc.row_offset.size());
    const int64_t row_bytes = p_.num_kv_heads * p_.head_dim * int64_t(sizeof(KT));
    const int64_t lines = (row_bytes + 63) / 64;
    const int64_t rows_ahead = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
    for (int64_t j = begin; j < end; ++j) {
      if (j + rows_ahead < keys) {
        const char* ahead = reinterpret_cast<const char*>(pool + offset[j + rows_ahead]);
        for (int64_t l = 0; l < lines; ++l) PrefetchLine(ahead + 64 * l);
      }
      visit(j, pool + offset[j]);
    }
  }

  void LoadQueries(const Item& it, int64_t q_start, F16* qs) const {
    const int64_t D = p_.head_dim, chunks = Chunks(), width = p_.num_q_heads * D;
    alignas(64) float row[kMaxHeadDim];
    for (int64_t i = 0; i < int64_t(it.rows) * p_.num_q_heads; ++i) {
      const QT* src = q_ + (q_start + it.row0) * width + i * D;  // rows are contiguous in q
      for (int64_t d = 0; d < D; ++d) row[d] = ToF32(src[d]) * p_.sm_scale;
      for (int64_t c = 0; c < chunks; ++c) qs[i * chunks + c] = Load(row + c * kLanes);
    }
  }

  // Each row's keys: causal (up to its own position) and, with a window, the last `window`.
  void Ranges(const Item& it, int64_t pos0, int64_t lo, int64_t hi, Scratch& sc) const {
    for (int64_t r = 0; r < it.rows; ++r) {
      const int64_t pos = pos0 + r;
      const int64_t a = p_.window > 0 ? std::max(lo, pos - (p_.window - 1)) : lo;
      const int64_t b = std::max(a, std::min(pos + 1, hi));
      for (int64_t h = 0; h < p_.num_q_heads; ++h) {
        sc.first[r * p_.num_q_heads + h] = a - lo;
        sc.last[r * p_.num_q_heads + h] = b - lo;
      }
    }
  }

  // scores[i, t - lo] = q_i . k_t(head of i) for every query vector i and key t in [lo, hi),
  // four keys at a time so that one reduction tree finishes four dot products.
  void Scores(const Item& it, int64_t lo, int64_t hi, Scratch& sc) const {
    const KT* rows[4];
    int64_t first = 0, count = 0;
    ForEachRow(k_, sc, 0, hi - lo, [&](int64_t j, const KT* src) {
      if (count == 0) first = j;
      rows[count++] = src;
      if (count == 4) {
        ScoreKeys(it, rows, 4, first, hi - lo, sc);
        count = 0;
      }
    });
    if (count > 0) ScoreKeys(it, rows, count, first, hi - lo, sc);
  }

  void ScoreKeys(const Item& it, const KT* const* rows, int64_t count, int64_t col, int64_t keys,
                 Scratch& sc) const {
    const int64_t chunks = Chunks(), G = p_.group, Hq = p_.num_q_heads;
    float* scores = sc.scores.data();
    const F16* q = sc.q.data();
    for (int64_t h = 0; h < p_.num_kv_heads; ++h) {
      F16 k[4][kChunks ? kChunks : kMaxChunks];
      for (int64_t j = 0; j < 4; ++j)
        for (int64_t c = 0; c < chunks; ++c)
          k[j][c] = Load(rows[std::min(j, count - 1)] + h * p_.head_dim + c * kLanes);
      for (int64_t r = 0; r < it.rows; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = r * Hq + h * G + g;
          const F16* qi = q + i * chunks;
          F16 s0 = qi[0] * k[0][0], s1 = qi[0] * k[1][0], s2 = qi[0] * k[2][0], s3 = qi[0] * k[3][0];
          for (int64_t c = 1; c < chunks; ++c) {
            s0 += qi[c] * k[0][c];
            s1 += qi[c] * k[1][c];
            s2 += qi[c] * k[2][c];
            s3 += qi[c] * k[3][c];
          }
          const F4 s = Sum4(s0, s1, s2, s3);
          for (int64_t j = 0; j < count; ++j) scores[i * keys + col + j] = s[j];
        }
    }
  }

  // Scores -> unnormalised probabilities exp(s - max) over each row's range; 1/sum kept aside.
  void Softmax(int64_t n, int64_t keys, Scratch& sc) const {
    for (int64_t i = 0; i < n; ++i) {
      float* s = sc.scores.data() + i * keys;
      const int64_t a = sc.first[i], b = sc.last[i];
      if (b <= a) continue;
      if (p_.soft_cap > 0)
        for (int64_t t = a; t < b; ++t) s[t] = p_.soft_cap * std::tanh(s[t] / p_.soft_cap);
      const float m = RangeMax(s, a, b);
      F16 sum = F16{};
      int64_t t = a;
      for (; t + kLanes <= b; t += kLanes) {
        F16 e = Exp(Load(s + t) - Splat(m));
        std::memcpy(s + t, &e, sizeof e);
        sum += e;
      }
      float total = Sum(sum);
      if (t < b) {  // tail: pad lanes with values that exp to zero
        alignas(64) float tail[kLanes];
        for (int l = 0; l < kLanes; ++l) tail[l] = t + l < b ? s[t + l] - m : -1e30f;
        F16 e = Exp(Load(tail));
        for (int l = 0; t + l < b; ++l) {
          s[t + l] = e[l];
          total += e[l];
        }
      }
      sc.inv_sum[i] = 1.0f / total;
      sc.max[i] = m;
      sc.total[i] = total;
    }
  }

  // acc[i] += p[i, t] * v_t(head of i) over row i's keys, in tiles of keys so each V row loaded
  // into L1 serves every query vector of the item while the accumulators stay in registers.
  void Values(const Item& it, int64_t lo, int64_t hi, Scratch& sc) const {
    const int64_t chunks = Chunks(), keys = hi - lo, Hkv = p_.num_kv_heads;
    const int64_t n = int64_t(it.rows) * p_.num_q_heads;
    F16* tile = sc.tile.data();
    const int64_t value_tile = ValueTile();
    for (int64_t t0 = 0; t0 < keys; t0 += value_tile) {
      const int64_t nt = std::min<int64_t>(value_tile, keys - t0);
      ForEachRow(v_, sc, t0, t0 + nt, [&](int64_t j, const KT* src) {
        F16* dst = tile + (j - t0) * Hkv * chunks;
        for (int64_t c = 0; c < Hkv * chunks; ++c) dst[c] = Load(src + c * kLanes);
      });
      for (int64_t i = 0; i < n; ++i) {
        const int64_t a = std::max(sc.first[i], t0), b = std::min(sc.last[i], t0 + nt);
        if (b <= a) continue;
        const int64_t h = (i % p_.num_q_heads) / p_.group;
        const float* prob = sc.scores.data() + i * keys;
        F16* acc = sc.acc.data() + i * chunks;
        F16 r[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) r[c] = acc[c];
        for (int64_t t = a; t < b; ++t) {
          const F16 w = Splat(prob[t]);
          const F16* vt = tile + ((t - t0) * Hkv + h) * chunks;
          for (int64_t c = 0; c < chunks; ++c) r[c] += w * vt[c];
        }
        for (int64_t c = 0; c < chunks; ++c) acc[c] = r[c];
      }
    }
  }

  void Store(const Item& it, int64_t q_start, const Scratch& sc) const {
    const int64_t D = p_.head_dim, chunks = Chunks(), width = p_.num_q_heads * D;
    for (int64_t i = 0; i < int64_t(it.rows) * p_.num_q_heads; ++i) {
      QT* dst = out_ + (q_start + it.row0) * width + i * D;
      for (int64_t c = 0; c < chunks; ++c) {
        const F16 o = sc.acc[i * chunks + c] * Splat(sc.inv_sum[i]);
        for (int l = 0; l < kLanes; ++l) FromF32(o[l], dst + c * kLanes + l);
      }
    }
  }

  void KeepPartial(int64_t n, const Scratch& sc, Partial* partial) const {
    const int64_t D = p_.head_dim, chunks = Chunks();
    partial->acc.resize(n * D);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < chunks; ++c)
        std::memcpy(&partial->acc[i * D + c * kLanes], &sc.acc[i * chunks + c], sizeof(F16));
    partial->max = sc.max;
    partial->total = sc.total;
  }

  int64_t Chunks() const { return kChunks ? kChunks : chunks_; }

  Problem p_;
  const QT* q_;
  const KT* k_;
  const KT* v_;
  QT* out_;
  int64_t chunks_;
};

// The item's rows (one) and key parts (SplitKeys) combined into out: each part's sums scaled by
// exp(its max - the largest max), then normalised. A row with no keys in any part is zeros.
template <typename QT>
void MergeParts(const Problem& p, QT* out, const Item& it, const std::vector<Partial>& parts) {
  const int64_t D = p.head_dim, n = int64_t(it.rows) * p.num_q_heads, width = p.num_q_heads * D;
  QT* dst = out + (p.cu[it.seq] + it.row0) * width;
  for (int64_t i = 0; i < n; ++i) {
    float largest = -std::numeric_limits<float>::infinity(), total = 0.0f;
    for (const Partial& part : parts) largest = std::max(largest, part.max[i]);
    alignas(64) float row[kMaxHeadDim] = {};
    for (const Partial& part : parts) {
      if (part.total[i] == 0.0f) continue;
      const float w = std::exp(part.max[i] - largest);
      total += w * part.total[i];
      for (int64_t d = 0; d < D; ++d) row[d] += w * part.acc[i * D + d];
    }
    const float scale = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < D; ++d) FromF32(row[d] * scale, dst + i * D + d);
  }
}

// Work items of all live sequences, each up to row_tile query rows, most expensive first
// (better balance across threads).
std::vector<Item> MakeItems(const Problem& p, int64_t row_tile) {
  std::vector<Item> items;
  for (int64_t s = 0; s < p.num_seqs; ++s) {
    const int64_t q_len = p.cu[s + 1] - p.cu[s];
    const int64_t kv = std::clamp<int64_t>(p.kv_lens[s], 0, p.width * p.page_size);
    for (int64_t r0 = 0; r0 < q_len; r0 += row_tile) {
      const int64_t rows = std::min<int64_t>(row_tile, q_len - r0);
      int64_t lo, hi;
      KeyRange(p, kv, kv - q_len + r0, rows, &lo, &hi);
      items.push_back({int32_t(s), int32_t(r0), int32_t(rows), rows * std::max<int64_t>(hi - lo, 1)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// Rows per item of the AVX-512 kernel: enough query vectors to reuse each K/V row many times, few
// enough that the item's queries and accumulators stay in L1 (64 vectors of 64 floats: 16 KB each).
int64_t RowTile(const Problem& p) { return std::clamp<int64_t>(kQueryVectors / p.num_q_heads, 1, 16); }

// A lone decode row (batch 1) is one item, which XLA's pool would run on one thread: with at
// least kSplitKeys keys it runs as two key parts instead, on the calling thread and the
// HelperThread (awake from the step's products), then merged.
constexpr int64_t kSplitKeys = 128;

template <typename Attn, typename Local>
struct SplitCall {
  const Attn* attention;
  std::vector<Item> parts;
  mutable std::vector<Local> scratch;
  mutable std::vector<Partial> partials;
};

template <typename Attn, typename Local>
void RunPart(const void* context, int64_t i) {
  const auto& call = *static_cast<const SplitCall<Attn, Local>*>(context);
  call.attention->Run(call.parts[i], call.scratch[i], &call.partials[i]);
}

// Whether `items` is one decode row with enough keys to split; its key range then in lo, hi.
bool SplitsKeys(const Problem& p, const std::vector<Item>& items, int64_t* lo, int64_t* hi) {
  if (items.size() != 1 || items[0].rows != 1) return false;
  const Item& it = items[0];
  const int64_t q_len = p.cu[it.seq + 1] - p.cu[it.seq];
  const int64_t kv = std::clamp<int64_t>(p.kv_lens[it.seq], 0, p.width * p.page_size);
  KeyRange(p, kv, kv - q_len + it.row0, 1, lo, hi);
  return *hi - *lo >= kSplitKeys;
}

// The lone decode row `item` as two key parts of [lo, hi) on the calling thread and the helper,
// then merged.
template <typename Local, typename Attn, typename QT>
void RunSplit(const Attn& attention, const Problem& p, QT* out, const Item& item, int64_t lo, int64_t hi) {
  SplitCall<Attn, Local> call{&attention, {item, item}, std::vector<Local>(2), std::vector<Partial>(2)};
  call.parts[0].part_hi = call.parts[1].part_lo = lo + (hi - lo) / 2;
  HelperThread::Run(RunPart<Attn, Local>, &call, 2);
  MergeParts(p, out, item, call.partials);
}

// Every item of the call through `attention` (AVX-512's Attention or AmxAttention, whose
// per-thread buffers are Local), its output rows of type QT.
template <typename Local, typename QT, typename Attn>
void RunItemsOf(ffi::ThreadPool& pool, const Problem& p, const Attn& attention, int64_t row_tile, QT* out) {
  const int64_t row = p.num_q_heads * p.head_dim;
  const int64_t live_end = std::clamp<int64_t>(p.cu[p.num_seqs], 0, p.num_tokens);
  std::fill(out + live_end * row, out + p.num_tokens * row, QT(0));  // padding rows
  auto items = std::make_shared<std::vector<Item>>(MakeItems(p, row_tile));
  int64_t lo, hi;
  if (SplitsKeys(p, *items, &lo, &hi)) return RunSplit<Local>(attention, p, out, items->front(), lo, hi);
  jaxrunner_cpu::RunItems<Local>(pool, int64_t(items->size()), [items, attention](int64_t i, Local& scratch) {
    attention.Run((*items)[i], scratch);
  });
}

// fn(std::integral_constant<int, kChunks>) for the head size: the AVX-512 kernel's loops are
// unrolled for 64 dims (4 chunks of 16) and 128 (8); 0 runs any other size.
template <typename Fn>
void WithChunks(int64_t head_dim, Fn fn) {
  if (head_dim == 64) fn(std::integral_constant<int, 4>{});
  else if (head_dim == 128) fn(std::integral_constant<int, 8>{});
  else fn(std::integral_constant<int, 0>{});
}

template <typename QT, typename KT>
void RunForHeadDim(ffi::ThreadPool& pool, const Problem& p, const void* q, const void* k, const void* v,
                   void* out) {
  WithChunks(p.head_dim, [&](auto chunks) {
    const Attention<QT, KT, decltype(chunks)::value> attention(
        p, static_cast<const QT*>(q), static_cast<const KT*>(k), static_cast<const KT*>(v), static_cast<QT*>(out));
    RunItemsOf<Scratch>(pool, p, attention, RowTile(p), static_cast<QT*>(out));
  });
}

#if JAXRUNNER_AMX_ATTENTION
struct MixedScratch {
  Scratch rows;
  AmxScratch tiles;
};

// Both kinds of items of one call: a decode row (an item of one query row, and the key parts of a
// lone one) stays on the AVX-512 kernel, where reading its K/V rows from memory, not multiplying
// them, sets the pace (on tiles it ran no faster); query rows of prefill chunks go to the tiles,
// which multiply them several times faster.
template <int kChunks>
struct MixedAttention {
  Attention<uint16_t, uint16_t, kChunks> rows;
  AmxAttention tiles;

  void Run(const Item& it, MixedScratch& sc, Partial* partial = nullptr) const {
    if (it.rows == 1) rows.Run(it, sc.rows, partial);
    else tiles.Run(it, sc.tiles);
  }
};

template <int kChunks>
void RunMixed(ffi::ThreadPool& pool, const Problem& p, const void* q, const void* k, const void* v, void* out) {
  const auto* qb = static_cast<const uint16_t*>(q);
  const auto *kb = static_cast<const uint16_t*>(k), *vb = static_cast<const uint16_t*>(v);
  auto* o = static_cast<uint16_t*>(out);
  const MixedAttention<kChunks> attention{{p, qb, kb, vb, o}, {p, qb, kb, vb, o}};
  RunItemsOf<MixedScratch>(pool, p, attention, AmxRowTile(p), o);
}
#endif

// bf16 queries and pages on AMX tiles (attention_amx.h) where `tiles` asks and the tiles take the
// problem; false leaves the call to the AVX-512 kernel.
bool RanOnTiles(ffi::ThreadPool& pool, const Problem& p, const void* q, const void* k, const void* v, void* out,
                bool tiles) {
#if JAXRUNNER_AMX_ATTENTION
  if (!tiles || !AmxAttentionFits(p)) return false;
  WithChunks(p.head_dim, [&](auto chunks) { RunMixed<decltype(chunks)::value>(pool, p, q, k, v, out); });
  return true;
#else
  (void)pool, (void)p, (void)q, (void)k, (void)v, (void)out, (void)tiles;
  return false;
#endif
}

bool ValidProblem(const Problem& p) {
  for (int64_t s = 0; s < p.num_seqs; ++s)
    if (p.cu[s] < 0 || p.cu[s + 1] < p.cu[s] || p.cu[s + 1] > p.num_tokens) return false;
  return true;
}

ffi::Error PagedAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages,
                          ffi::AnyBuffer v_pages, ffi::Buffer<ffi::S32> kv_lens,
                          ffi::Buffer<ffi::S32> page_indices, ffi::Buffer<ffi::S32> cu_q_lens,
                          ffi::Buffer<ffi::S32> num_seqs, ffi::Result<ffi::AnyBuffer> out,
                          float sm_scale, float soft_cap, int64_t sliding_window, int64_t tiles) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions(), pd = page_indices.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || pd.size() != 2 || kd[3] != qd[2] || qd[1] % kd[2] != 0)
    return ffi::Error::InvalidArgument("paged attention: bad shapes");
  if (qd[2] % kLanes != 0 || qd[2] > kMaxHeadDim)
    return ffi::Error::InvalidArgument("paged attention: head_dim must be a multiple of 16, at most 256");
  Problem p{qd[0], qd[1], qd[2], kd[0], kd[1], kd[2], pd[1], qd[1] / kd[2],
            std::clamp<int64_t>(num_seqs.typed_data()[0], 0, pd[0]),
            sm_scale, soft_cap, sliding_window,
            kv_lens.typed_data(), page_indices.typed_data(), cu_q_lens.typed_data()};
  if (!ValidProblem(p)) return ffi::Error::InvalidArgument("paged attention: bad cu_q_lens");
  const auto qt = q.element_type(), kt = k_pages.element_type();
  const void *qp = q.untyped_data(), *kp = k_pages.untyped_data(), *vp = v_pages.untyped_data();
  void* op = out->untyped_data();
  const bool q32 = qt == ffi::DataType::F32;
  if (qt != ffi::DataType::F32 && qt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("paged attention: q must be float32 or bfloat16");
  if (v_pages.element_type() != kt)
    return ffi::Error::InvalidArgument("paged attention: k and v pages must share a dtype");
  if (qt == ffi::DataType::BF16 && kt == ffi::DataType::BF16 && RanOnTiles(pool, p, qp, kp, vp, op, tiles != 0))
    return ffi::Error::Success();
  auto run = [&](auto page_type) {
    using KT = decltype(page_type);
    if (q32) RunForHeadDim<float, KT>(pool, p, qp, kp, vp, op);
    else RunForHeadDim<uint16_t, KT>(pool, p, qp, kp, vp, op);
  };
  switch (kt) {
    case ffi::DataType::F32: run(float{}); break;
    case ffi::DataType::BF16: run(uint16_t{}); break;
    case ffi::DataType::F8E4M3FN: run(E4M3{}); break;
    case ffi::DataType::F8E5M2: run(E5M2{}); break;
    default:
      return ffi::Error::InvalidArgument("paged attention: pages must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// KV page write: out pools alias the input pools (input_output_aliases), so XLA hands the donated
// pool buffers straight through and only the step's T rows are touched -- in any dtype. (XLA:CPU
// itself cannot scatter bfloat16 in place: it converts the whole pool to f32 and back.)

template <typename NT, typename PT>
void WriteRows(const NT* src, PT* pool, const int32_t* slots, int64_t tokens, int64_t row,
               int64_t num_slots, int64_t scratch_slot) {
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t slot = slots[t];
    if (slot < 0 || slot >= num_slots) slot = scratch_slot;  // a bug upstream: never a live page
    PT* dst = pool + slot * row;
    for (int64_t i = 0; i < row; ++i) FromF32(ToF32(src[t * row + i]), dst + i);
  }
}

template <typename PT>
void WritePool(const ffi::AnyBuffer& pool_in, ffi::AnyBuffer* pool_out, const ffi::AnyBuffer& rows,
               const int32_t* slots, int64_t tokens, int64_t row, int64_t num_slots) {
  PT* dst = static_cast<PT*>(pool_out->untyped_data());
  if (pool_out->untyped_data() != pool_in.untyped_data())  // not aliased: start from the input
    std::memcpy(pool_out->untyped_data(), pool_in.untyped_data(), pool_in.size_bytes());
  if (rows.element_type() == ffi::DataType::F32)
    WriteRows(static_cast<const float*>(rows.untyped_data()), dst, slots, tokens, row, num_slots, 0);
  else
    WriteRows(static_cast<const uint16_t*>(rows.untyped_data()), dst, slots, tokens, row, num_slots, 0);
}

ffi::Error WriteKv(ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_new,
                   ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> slot_mapping,
                   ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  using ffi::DataType;
  const auto kd = k_pages.dimensions(), nd = k_new.dimensions();
  if (kd.size() != 4 || nd.size() != 3 || nd[1] != kd[2] || nd[2] != kd[3] ||
      slot_mapping.element_count() != size_t(nd[0]))
    return ffi::Error::InvalidArgument("write_kv: bad shapes");
  const auto pt = k_pages.element_type(), nt = k_new.element_type();
  const bool ok_types = (nt == DataType::F32 || nt == DataType::BF16) && v_pages.element_type() == pt &&
                        v_new.element_type() == nt;
  if (!ok_types) return ffi::Error::InvalidArgument("write_kv: rows must be float32 or bfloat16, k and v alike");
  const int64_t row = kd[2] * kd[3], num_slots = kd[0] * kd[1], tokens = nd[0];
  const int32_t* slots = slot_mapping.typed_data();
  auto write_both = [&](auto pool_type) {
    using PT = decltype(pool_type);
    WritePool<PT>(k_pages, &*k_out, k_new, slots, tokens, row, num_slots);
    WritePool<PT>(v_pages, &*v_out, v_new, slots, tokens, row, num_slots);
  };
  switch (pt) {
    case DataType::F32: write_both(float{}); break;
    case DataType::BF16: write_both(uint16_t{}); break;
    case DataType::F8E4M3FN: write_both(E4M3{}); break;
    case DataType::F8E5M2: write_both(E5M2{}); break;
    default:
      return ffi::Error::InvalidArgument("write_kv: pools must be float32, bfloat16, float8_e4m3fn or float8_e5m2");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuWriteKv, WriteKv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // k_pages (aliased to k_out)
                                  .Arg<ffi::AnyBuffer>()         // v_pages (aliased to v_out)
                                  .Arg<ffi::AnyBuffer>()         // k_new [T, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()         // v_new
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()         // k_out
                                  .Ret<ffi::AnyBuffer>());       // v_out

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuPagedAttention, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()        // q
                                  .Arg<ffi::AnyBuffer>()        // k_pages
                                  .Arg<ffi::AnyBuffer>()        // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>() // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>() // page_indices
                                  .Arg<ffi::Buffer<ffi::S32>>() // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>() // num_seqs
                                  .Ret<ffi::AnyBuffer>()        // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("tiles"));   // 1: bf16 on AMX tiles where it fits

// 1 where this build has the AMX-BF16 attention and the kernel grants AMX to the process (for ctypes).
extern "C" int JaxrunnerCpuAttentionTilesReady() {
#if JAXRUNNER_AMX_ATTENTION
  return AmxGranted() ? 1 : 0;
#else
  return 0;
#endif
}
