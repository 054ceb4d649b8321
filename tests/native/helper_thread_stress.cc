// Drives kernels/cpu/helper_thread.h with back-to-back calls of a few tiny items, as a decode
// step's products do, and checks after each call that every item ran exactly once.
// Usage: helper_thread_stress CALLS; prints "ok CALLS" and exits 0, or says where it failed.
#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "helper_thread.h"

namespace {

std::atomic<long> ran{0};

void CountItem(const void*, int64_t) { ran.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

int main(int argc, char** argv) {
  const long calls = argc > 1 ? std::atol(argv[1]) : 1000000;
  long expected = 0;
  for (long call = 0; call < calls; ++call) {
    const int64_t items = 2 + call % 3;
    jaxrunner_cpu::HelperThread::Run(CountItem, nullptr, items);
    expected += items;
    if (ran.load() != expected) {
      std::printf("call %ld: %ld items ran, %ld expected\n", call, ran.load(), expected);
      return 1;
    }
  }
  std::printf("ok %ld\n", calls);
  return 0;
}
