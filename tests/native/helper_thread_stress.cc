// Drives kernels/cpu/helper_thread.h with back-to-back calls of a few tiny items, as a decode
// step's products do, and checks after each call that every item ran exactly once, the calling
// thread's items a run from the front and the helper's a run from the back.
// Usage: helper_thread_stress CALLS; prints "ok CALLS" and exits 0, or says where it failed.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "helper_thread.h"

namespace {

constexpr int kMostItems = 9;

struct Call {
  std::thread::id caller;
  std::atomic<int> runs[kMostItems];
  std::atomic<bool> by_caller[kMostItems];
};

void RecordItem(const void* context, int64_t item) {
  Call& call = *static_cast<Call*>(const_cast<void*>(context));
  call.by_caller[item].store(std::this_thread::get_id() == call.caller, std::memory_order_relaxed);
  call.runs[item].fetch_add(1, std::memory_order_relaxed);
}

// Empty when the call ran as it should, else what went wrong.
const char* Check(const Call& call, int64_t items) {
  bool helper_seen = false;
  for (int64_t i = 0; i < items; ++i) {
    if (call.runs[i].load() != 1) return "an item did not run exactly once";
    const bool by_caller = call.by_caller[i].load();
    if (by_caller && helper_seen) return "the caller ran an item after one the helper ran";
    helper_seen = helper_seen || !by_caller;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  const long calls = argc > 1 ? std::atol(argv[1]) : 1000000;
  long helped = 0;
  for (long c = 0; c < calls; ++c) {
    const int64_t items = 2 + c % (kMostItems - 1);
    Call call;
    call.caller = std::this_thread::get_id();
    for (int i = 0; i < kMostItems; ++i) call.runs[i] = 0, call.by_caller[i] = true;
    jaxrunner_cpu::HelperThread::Run(RecordItem, &call, items);
    const char* error = Check(call, items);
    if (*error) {
      std::printf("call %ld of %ld items: %s\n", c, long(items), error);
      return 1;
    }
    helped += !call.by_caller[items - 1].load();
  }
  std::printf("ok %ld\n", calls);
  std::fprintf(stderr, "the helper took items in %ld calls\n", helped);
  return 0;
}
