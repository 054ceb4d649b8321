// The sampler's top-k / top-p thresholds for XLA:CPU, as an XLA FFI custom call: per row of
// float32 logits, the smallest logit a token may have and still be kept, with the semantics of
// jaxrunner/runner/sampler.py's _exact_thresholds (vLLM's): the k-th largest logit (ties with it
// stay), then, over that top-k set renormalised, the smallest logit v whose set's probability mass
// above v is below top_p (the tokens tied at v stay, as after a sort). -inf where neither is on.
//
// Why: XLA has no selection but a sort or TopK, and on XLA:CPU a row-wise reduction over the
// vocabulary costs about three times a plain sum: the best 256 logits by TopK, and the bisection
// for rows they do not decide, took tens of milliseconds per 64-row step. Here each row is a few
// passes: its largest (and smallest finite) value, the weights (1 for top-k, exp(l - max) for
// top-p), a histogram of the weights over kBins value bins, a walk down the bins to the one where
// the mass above crosses the target, and a sort of that bin's few values. Rows spread over XLA's
// intra-op pool. A NaN logit is never kept (read as -inf), as the mask `logits >= threshold` does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "vec.h"
#include "work_queue.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxrunner_cpu;

constexpr int kBins = 2048;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct Scratch {
  std::vector<float> values, weights;  // the row's set (all of it, or its top-k set) and weights
  std::vector<int32_t> bins;           // each value's bin
  std::vector<double> bin_weight;
  std::vector<std::pair<float, float>> chosen;  // (value, weight) of the bin the target falls in
};

// The smallest value v of values[0, n) (none NaN) whose larger values' weights (1 each when
// `weights` is null) sum to less than `target` > 0: a histogram over [lowest finite, highest],
// then a sort of the one bin where the sum crosses the target. Summed in double.
float SmallestBelowTarget(const float* values, const float* weights, int64_t n, double target, float lowest,
                          float highest, Scratch& sc) {
  const float scale = highest > lowest ? float(kBins) / (highest - lowest) : 0.0f, last = float(kBins - 1);
  sc.bins.resize(n);
  int32_t* bins = sc.bins.data();
  for (int64_t i = 0; i < n; ++i) {  // (a loop the compiler vectorises)
    float f = (values[i] - lowest) * scale;  // -inf (and below lowest): bin 0
    f = f > 0.0f ? f : 0.0f;
    bins[i] = int32_t(f < last ? f : last);
  }
  sc.bin_weight.assign(kBins, 0.0);
  double* bin_weight = sc.bin_weight.data();
  if (weights)
    for (int64_t i = 0; i < n; ++i) bin_weight[bins[i]] += weights[i];
  else
    for (int64_t i = 0; i < n; ++i) bin_weight[bins[i]] += 1.0;
  double above = 0.0;
  int64_t bin = -1;
  for (int64_t b = kBins - 1; b >= 0; --b) {  // (a bin of no weight never holds the crossing)
    if (bin_weight[b] > 0.0 && above + bin_weight[b] >= target) {
      bin = b;
      break;
    }
    above += bin_weight[b];
  }
  sc.chosen.clear();
  for (int64_t i = 0; i < n; ++i)
    if (bin < 0 || bins[i] == bin) sc.chosen.emplace_back(values[i], weights ? weights[i] : 1.0f);
  if (bin < 0) above = 0.0;  // rounding left the whole set under the target: the smallest value
  std::sort(sc.chosen.begin(), sc.chosen.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  float v = sc.chosen.empty() ? lowest : sc.chosen.front().first;
  for (size_t i = 0; i < sc.chosen.size();) {
    v = sc.chosen[i].first;
    double tied = 0.0;
    for (; i < sc.chosen.size() && sc.chosen[i].first == v; ++i) tied += sc.chosen[i].second;
    if (bin >= 0 && above + tied >= target) return v;
    above += tied;
  }
  return v;
}

// values[i] = x[i], NaN read as -inf; the largest value and the smallest finite one (lowest =
// highest = -inf when nothing is finite), kLanes running extremes at a time: one chain of scalar
// maxima waits on each comparison.
void LoadRow(const float* x, int64_t n, float* values, float* lowest, float* highest) {
  float lo[kLanes], hi[kLanes];
  for (int l = 0; l < kLanes; ++l) lo[l] = kInf, hi[l] = -kInf;
  auto take = [&](int64_t i, int l) {
    const float v = x[i] == x[i] ? x[i] : -kInf;
    values[i] = v;
    hi[l] = v > hi[l] ? v : hi[l];
    lo[l] = (v < lo[l] && v > -kInf) ? v : lo[l];
  };
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) take(i + l, l);
  for (; i < n; ++i) take(i, 0);
  *highest = *std::max_element(hi, hi + kLanes);
  const float smallest = *std::min_element(lo, lo + kLanes);
  *lowest = smallest == kInf ? -kInf : smallest;
}

float RowThreshold(const float* row, int64_t vocab, int32_t top_k, float top_p, Scratch& sc) {
  const bool k_on = top_k > 0 && top_k < vocab, p_on = top_p < 1.0f;
  if (!k_on && !p_on) return -kInf;
  sc.values.resize(vocab);
  float lowest, highest;
  LoadRow(row, vocab, sc.values.data(), &lowest, &highest);
  float kth = -kInf;
  int64_t n = vocab;
  if (k_on) {
    kth = SmallestBelowTarget(sc.values.data(), nullptr, vocab, double(top_k), lowest, highest, sc);
    n = 0;  // the top-k set, moved to the front
    for (int64_t i = 0; i < vocab; ++i)
      if (sc.values[i] >= kth) sc.values[n++] = sc.values[i];
    if (kth > -kInf) lowest = kth;
  }
  if (!p_on || highest == -kInf) return kth;
  sc.weights.resize(n + kLanes);
  float* w = sc.weights.data();
  double total = 0.0;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const F16 e = Exp(Load(sc.values.data() + i) - Splat(highest));
    Store(e, w + i);
    total += Sum(e);
  }
  for (; i < n; ++i) total += (w[i] = std::exp(sc.values[i] - highest));
  const float nucleus = SmallestBelowTarget(sc.values.data(), w, n, double(top_p) * total, lowest, highest, sc);
  return std::max(kth, nucleus);
}

ffi::Error Thresholds(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::S32> top_k,
                      ffi::Buffer<ffi::F32> top_p, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || top_k.element_count() != ld[0] || top_p.element_count() != ld[0] ||
      out->element_count() != ld[0])
    return ffi::Error::InvalidArgument("sampling_thresholds: logits [S, V], top_k [S], top_p [S], out [S]");
  const int64_t rows = ld[0], vocab = ld[1];
  const float* x = logits.typed_data();
  const int32_t* k = top_k.typed_data();
  const float* p = top_p.typed_data();
  float* result = out->typed_data();
  RunItems<Scratch>(pool, rows, [=](int64_t r, Scratch& sc) {
    result[r] = RowThreshold(x + r * vocab, vocab, k[r], p[r], sc);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrunnerCpuSamplingThresholds, Thresholds,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // logits [S, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // top_k [S]: 0 off
                                  .Arg<ffi::Buffer<ffi::F32>>()   // top_p [S]: 1 off
                                  .Ret<ffi::Buffer<ffi::F32>>());  // thresholds [S]
