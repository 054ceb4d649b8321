// One persistent helper thread that shares the items of short kernel calls with the caller.
//
// Why: a decode step makes a few hundred products of tens of microseconds each. Waking one of
// XLA's pool threads for each costs about as long as the product itself, so those products ran
// on one core while the other idled. This helper stays awake (yielding) for a short while after
// each call, so the next call of the same step finds it ready; between steps it sleeps.
//
// One call at a time uses the helper; a call that finds it taken runs alone. Items are claimed
// with a compare-and-swap on (generation, items taken from the front, items taken from the back),
// so a helper that arrives late to a call claims nothing of it and never touches its buffers once
// the caller has returned. The caller takes items from the front and the helper from the back:
// a kernel's items are consecutive pieces of its weight, so each thread then reads one stream of
// memory whose next lines its prefetches have already asked for, where items taken in turns made
// both threads start every item cold (docs/performance.md has the measurements).
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
  // The claim word: generation (24 bits), items taken from the front (20), from the back (20).
  static constexpr int kCountBits = 20;
  static constexpr int64_t kMaxItems = (int64_t(1) << kCountBits) - 1;  // more run on the caller alone
  static constexpr uint64_t kGenerations = uint64_t(1) << 24;

  static uint64_t Claim(uint64_t generation, int64_t front, int64_t back) {
    return ((generation % kGenerations) << (2 * kCountBits)) | (uint64_t(front) << kCountBits) | uint64_t(back);
  }
  static bool OfGeneration(uint64_t claim, uint64_t generation) {
    return (claim >> (2 * kCountBits)) == generation % kGenerations;
  }

  HelperThread() { std::thread([this] { Loop(); }).detach(); }

  void Share(Task task, const void* context, int64_t items) {
    std::unique_lock<std::mutex> owner(owner_, std::try_to_lock);
    if (items <= 1 || items > kMaxItems || !owner.owns_lock()) {
      for (int64_t i = 0; i < items; ++i) task(context, i);
      return;
    }
    const uint64_t generation = ++generation_;
    // Close the last call's claims before its items_ changes: a helper still in Drain for it may
    // read the new items_ (then its claim fails) but never claim past the old count.
    claim_.store(Claim(generation, kMaxItems, 0));
    task_.store(task, std::memory_order_relaxed);
    context_.store(context, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    items_.store(items, std::memory_order_release);
    claim_.store(Claim(generation, 0, 0), std::memory_order_release);
    posted_.store(generation);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mu_);
      wake_.notify_one();
    }
    Drain(generation, /*from_back=*/false);
    while (done_.load(std::memory_order_acquire) != items) std::this_thread::yield();
  }

  // Claims and runs the items of `generation` that are left, from the front or from the back.
  void Drain(uint64_t generation, bool from_back) {
    const uint64_t one = from_back ? 1 : uint64_t(1) << kCountBits;
    uint64_t c = claim_.load(std::memory_order_acquire);
    while (OfGeneration(c, generation)) {
      const int64_t front = int64_t((c >> kCountBits) & kMaxItems), back = int64_t(c & kMaxItems);
      const int64_t items = items_.load(std::memory_order_acquire);
      if (front + back >= items) return;
      if (!claim_.compare_exchange_weak(c, c + one, std::memory_order_acq_rel, std::memory_order_acquire)) continue;
      task_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed),
                                             from_back ? items - 1 - back : front);
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
      Drain(seen, /*from_back=*/true);
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
