// One persistent helper thread that shares the items of short kernel calls with the caller.
//
// Why: a decode step makes a few hundred products of tens of microseconds each. Waking one of
// XLA's pool threads for each costs about as long as the product itself, so those products ran
// on one core while the other idled. This helper stays awake (yielding) for a short while after
// each call, so the next call of the same step finds it ready; between steps it sleeps.
//
// One call at a time uses the helper; a call that finds it taken runs alone. Items are claimed
// with a compare-and-swap on (generation, next item), so a helper that arrives late to a call
// claims nothing of it and never touches its buffers once the caller has returned.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace jaxrunner_cpu {

constexpr int64_t kHelperThreads = 2;  // threads a HelperThread::Run call works on: the caller and the helper

class HelperThread {
 public:
  using Task = void (*)(const void* context, int64_t item);

  // Runs task(context, i) for every i in [0, items); returns when all have run.
  static void Run(Task task, const void* context, int64_t items) {
    static HelperThread* helper = new HelperThread();  // never destroyed: sleeps through exit
    helper->Share(task, context, items);
  }

 private:
  static constexpr auto kAwake = std::chrono::microseconds(300);  // time awake after a call
  static constexpr uint64_t kClosed = 0xffffffffu;                 // a claim index past any call's items

  HelperThread() { std::thread([this] { Loop(); }).detach(); }

  void Share(Task task, const void* context, int64_t items) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (items <= 1 || !owner.owns_lock()) {
      for (int64_t i = 0; i < items; ++i) task(context, i);
      return;
    }
    const uint64_t generation = ++generation_;  // wraps at 2^32, as claim_ holds it
    // Close the last call's claims before its items_ changes: a helper still in Drain for it may
    // read the new items_ (then its claim fails) but never claim past the old count.
    claim_.store((generation << 32) | kClosed);
    task_.store(task, std::memory_order_relaxed);
    context_.store(context, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    items_.store(items, std::memory_order_release);
    claim_.store(generation << 32, std::memory_order_release);
    posted_.store(generation);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_one();
    }
    Drain(generation);
    while (done_.load(std::memory_order_acquire) != items) std::this_thread::yield();
  }

  // Claims and runs the items of `generation` that are left.
  void Drain(uint64_t generation) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    while ((c >> 32) == generation) {
      const int64_t item = int64_t(c & 0xffffffffu);
      const int64_t items = items_.load(std::memory_order_acquire);
      if (item >= items) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      task_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed), item);
      done_.fetch_add(1, std::memory_order_release);
      c = claim_.load(std::memory_order_acquire);
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kAwake;
      while (posted_.load() == seen && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      if (posted_.load() == seen) {
        sleeping_.store(true);
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return posted_.load() != seen; });
        sleeping_.store(false);
      }
      seen = posted_.load();
      Drain(seen);
    }
  }

  std::mutex owner_;  // held by the call using the helper
  uint32_t generation_ = 0;
  std::atomic<uint64_t> claim_{0}, posted_{0};
  std::atomic<Task> task_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::atomic<int64_t> items_{0}, done_{0};
  std::atomic<bool> sleeping_{false};
  std::mutex mu_;
  std::condition_variable wake_;
};

}  // namespace jaxrunner_cpu
