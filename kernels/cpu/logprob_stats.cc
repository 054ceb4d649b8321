// What a sampled token's logprob needs, per row of float32 logits, for XLA:CPU as an XLA FFI
// custom call: the row's log normalizer, log(sum(exp(logits))) as jax.nn.logsumexp computes it
// (the largest logit plus the log of the exponentials' sum after subtracting it), and the chosen
// token's rank, vLLM's 1 + the number of logits strictly above the chosen one.
//
// Why: XLA:CPU ran these as three row-wise reductions over the vocabulary (the maximum, the sum
// of exponentials, the count), each about three times a plain sum's time: most of the sampler's
// time for logprobs=0, what RL rollouts and OpenAI `logprobs` requests take (docs/performance.md
// has the measurements). Here each row is read twice, once for the maximum and the count, once
// from L2 for the exponentials, rows spread over XLA's intra-op pool.
//
// Edge cases as XLA's: a NaN logit makes the normalizer NaN; a row whose largest logit is
// infinite gets that infinity; a chosen id outside the row counts nothing (rank 1).
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr float kInf = std::numeric_limits<float>::infinity();

struct NoScratch {};

// The row's largest logit (NaN if any is NaN) and how many logits exceed `chosen`, kLanes running
// values at a time (loops the compiler vectorises), where one chain of scalar maxima would wait
// on each comparison.
void MaxAndCount(const float* x, int64_t n, float chosen, float* largest, int64_t* above) {
  float hi[kLanes];
  int32_t nan[kLanes] = {}, count[kLanes] = {};
  for (int l = 0; l < kLanes; ++l) hi[l] = -kInf;
  auto take = [&](int64_t i, int l) {
    const float v = x[i];
    hi[l] = v > hi[l] ? v : hi[l];
    nan[l] |= v != v;
    count[l] += v > chosen;
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) take(i + l, l);
  for (; i < n; ++i) take(i, 0);
  float best = -kInf;
  int64_t total = 0;
  bool any_nan = false;
  for (int l = 0; l < kLanes; ++l) {
    best = hi[l] > best ? hi[l] : best;
    total += count[l];
    any_nan |= nan[l] != 0;
  }
  *largest = any_nan ? std::numeric_limits<float>::quiet_NaN() : best;
  *above = total;
}

float LogNormalizer(const float* x, int64_t n, float largest) {
  if (!std::isfinite(largest)) return largest;  // NaN, or every logit -inf, or an infinite one
  const F16 shift = Splat(largest);
  F16 lanes = Splat(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) lanes += Exp(Load(x + i) - shift);
  float sum = Sum(lanes);
  for (; i < n; ++i) sum += std::exp(x[i] - largest);
  return largest + std::log(sum);
}

ffi::Error LogprobStats(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> chosen,
                        ffi::Result<ffi::Buffer<ffi::F32>> normalizer, ffi::Result<ffi::Buffer<ffi::S32>> rank) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || chosen.element_count() != ld[0] || normalizer->element_count() != ld[0] ||
      rank->element_count() != ld[0])
    return ffi::Error::InvalidArgument("logprob_stats: logits [S, V], chosen [S], normalizer [S], rank [S]");
  const int64_t vocab = ld[1];
  const float* x = logits.typed_data();
  const int32_t* ids = chosen.typed_data();
  float* norm = normalizer->typed_data();
  int32_t* ranks = rank->typed_data();
  RunItems<NoScratch>(pool, ld[0], [=](int64_t r, NoScratch&) {
    const float* row = x + r * vocab;
    const int32_t id = ids[r];
    const float value = (id >= 0 && id < vocab) ? row[id] : std::numeric_limits<float>::quiet_NaN();
    float largest;
    int64_t above;
    MaxAndCount(row, vocab, value, &largest, &above);
    norm[r] = LogNormalizer(row, vocab, largest);
    ranks[r] = static_cast<int32_t>(above + 1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuLogprobStats, LogprobStats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()    // logits [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // chosen token ids [S]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // log normalizer [S]
                                  .Ret<ffi::Buffer<ffi::S32>>());  // rank [S]
