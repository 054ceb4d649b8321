// Work items of one kernel call spread over XLA's intra-op thread pool. The calling thread drains
// the queue too, so nothing waits on a task that never gets a thread. Helpers that start after all
// items are claimed touch only the queue (never the call's buffers), so it outlives the call
// through shared_ptr.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxrunner_cpu {

// Local: per-thread state of the items a thread runs (scratch buffers), made once per thread.
template <typename Local>
struct WorkQueue {
  std::function<void(int64_t, Local&)> run;
  int64_t num_items = 0;
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable all_done;

  void Drain() {
    Local local;
    for (int64_t i; (i = next.fetch_add(1)) < num_items;) {
      run(i, local);
      if (done.fetch_add(1) + 1 == num_items) {
        std::lock_guard<std::mutex> lock(mu);
        all_done.notify_all();
      }
    }
  }
};

// Runs run(i, local) for i in [0, num_items) on the pool and the calling thread; returns when all
// are done. `run` must capture by value whatever it needs.
template <typename Local>
void RunItems(xla::ffi::ThreadPool& pool, int64_t num_items, std::function<void(int64_t, Local&)> run) {
  if (num_items <= 0) return;
  auto queue = std::make_shared<WorkQueue<Local>>();
  queue->num_items = num_items;
  queue->run = std::move(run);
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_items - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([queue] { queue->Drain(); });
  queue->Drain();
  std::unique_lock<std::mutex> lock(queue->mu);
  queue->all_done.wait(lock, [&] { return queue->done.load() >= queue->num_items; });
}

}  // namespace jaxrunner_cpu
