// How a call's work is shared out among XLA's intra-op threads: a Gang of the caller and the
// helpers it schedules, each taking work items until none is left.

#pragma once

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Wait until done() holds: spin briefly, then give the core away between checks. The thread
// waited for may itself be waiting for a core (XLA's threads, the Python thread that drives
// the engine and other processes share few cores), and spinning on would starve it.
template <typename Done>
inline void wait_until(Done done) {
  for (int spins = 0; !done(); ++spins) {
#if defined(__x86_64__)
    if (spins < 512) {
      _mm_pause();
      continue;
    }
#endif
    std::this_thread::yield();
  }
}

// One call's work, shared out among XLA's intra-op threads: the caller and the helpers it
// schedules each run drain() until no item is left. A helper that starts after the caller
// has closed the call returns at once (the pool may run tasks late, or inline). The caller
// waits (wait_until) while a started helper finishes its last item, usually microseconds:
// sleeping on a condition variable here cost more than the work of a small layer.
struct Gang {
  static constexpr int64_t kClosed = int64_t{1} << 40;
  std::atomic<int64_t> state{0};  // helpers running, plus kClosed once the caller is done

  virtual ~Gang() = default;
  virtual void drain() = 0;

  void help() {
    int64_t s = state.load(std::memory_order_relaxed);
    do {
      if (s & kClosed) return;
    } while (!state.compare_exchange_weak(s, s + 1, std::memory_order_acquire));
    drain();
    state.fetch_sub(1, std::memory_order_release);
  }

  void finish() {
    drain();
    state.fetch_or(kClosed, std::memory_order_acq_rel);
    wait_until([&] { return (state.load(std::memory_order_acquire) & ~kClosed) == 0; });
  }
};

// Calls with less work than this run on the caller alone: a helper costs more than it saves
// there, and takes the core the engine's thread starts the next forward on. Work: bytes of
// weights as float32 (or of keys and values) read, times the passes over them (one per tile
// of four inputs, or per query head).
constexpr int64_t kSoloWork = 512 << 10;

// Helper threads of the kernels' own, beside XLA's pool: between calls each waits for the next
// spinning (then yielding its core), for kSpin after its last call, before it sleeps. A step's
// calls follow one another a few microseconds apart, so a call finds its helpers awake and
// they start on it at once. Through the pool (pool.Schedule, its thread asleep between calls)
// the caller spent ~20 µs scheduling and the helper arrived ~35 µs after that (a 16-row expert
// call of ~1.3 ms: ~5% of it; docs/kernels.md, "Helpers of their own"). A call that finds a
// helper busy (another call at the same time) schedules one from the pool instead.
class Crew {
 public:
  static constexpr auto kSpin = std::chrono::milliseconds(2);

  // Offer the gang to up to n helpers; the number that took it (each runs gang->help() once).
  int64_t post(Gang* gang, int64_t n) {
    if (n <= 0 || forked()) return 0;
    grow(n);
    int64_t posted = 0;
    for (int64_t i = 0; i < n; ++i) {
      Member& m = *members_[i];
      Gang* idle = nullptr;
      if (!m.job.compare_exchange_strong(idle, gang)) continue;
      ++posted;
      // (Sequentially consistent, as the member's own store and load below: it either sees
      // the job before it sleeps, or is seen asleep here and woken.)
      if (m.asleep.load()) {
        std::lock_guard<std::mutex> lock(m.mu);
        m.wake.notify_one();
      }
    }
    return posted;
  }

  // After gang->finish(): take the gang back from helpers that have not started on it, and
  // wait for those that have to let go of it, so that it may be freed.
  void retract(Gang* gang, int64_t n) {
    if (forked()) return;
    n = std::min<int64_t>(n, count_.load(std::memory_order_acquire));
    for (int64_t i = 0; i < n; ++i) {
      Member& m = *members_[i];
      Gang* mine = gang;
      if (m.job.compare_exchange_strong(mine, nullptr, std::memory_order_acq_rel)) continue;
      if (mine == claimed(gang))
        wait_until([&] { return m.job.load(std::memory_order_acquire) != claimed(gang); });
    }
  }

  static Crew& get() {
    static Crew* crew = [] {
      pthread_atfork(nullptr, nullptr, [] { forked() = true; });  // (no threads in a child)
      return new Crew;  // never freed: its threads outlive every call
    }();
    return *crew;
  }

 private:
  struct Member {
    std::atomic<Gang*> job{nullptr};  // a call on offer, or claimed (its lowest bit set)
    std::atomic<bool> asleep{false};
    std::mutex mu;
    std::condition_variable wake;
  };

  static Gang* claimed(Gang* gang) {
    return reinterpret_cast<Gang*>(reinterpret_cast<uintptr_t>(gang) | 1);
  }
  static bool& forked() {
    static bool f = false;
    return f;
  }

  // Members [0, n) exist and run; only callers holding grow_'s lock add any.
  void grow(int64_t n) {
    if (static_cast<int64_t>(count_.load(std::memory_order_acquire)) >= n) return;
    std::lock_guard<std::mutex> lock(grow_);
    while (count_.load(std::memory_order_relaxed) < n) {
      Member* m = new Member;  // never freed, as the crew
      members_[count_.load(std::memory_order_relaxed)] = m;
      std::thread([m] { serve(*m); }).detach();
      count_.fetch_add(1, std::memory_order_release);
    }
  }

  static void serve(Member& m) {
    auto last = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      Gang* gang = m.job.load(std::memory_order_acquire);
      if (gang && !(reinterpret_cast<uintptr_t>(gang) & 1)) {
        if (m.job.compare_exchange_strong(gang, claimed(gang), std::memory_order_acq_rel)) {
          gang->help();
          m.job.store(nullptr, std::memory_order_release);
          last = std::chrono::steady_clock::now();
        }
        spins = 0;
        continue;
      }
#if defined(__x86_64__)
      if (spins < 512) {
        _mm_pause();
        continue;
      }
#endif
      if (std::chrono::steady_clock::now() - last < kSpin) {
        std::this_thread::yield();
        continue;
      }
      std::unique_lock<std::mutex> lock(m.mu);
      m.asleep.store(true);
      m.wake.wait(lock, [&] { return m.job.load() != nullptr; });
      m.asleep.store(false);
      last = std::chrono::steady_clock::now();
    }
  }

  static constexpr int kMost = 256;
  std::mutex grow_;
  std::atomic<int64_t> count_{0};
  Member* members_[kMost] = {};
};

// Whether calls take the crew's helpers (colibri_own_helpers, cpu.cc; kernels.own_helpers)
// or only the pool's.
std::atomic<int32_t> own_helpers{1};

// Run `gang` on the caller and up to items - 1 helpers (none below kSoloWork): the crew's,
// and the pool's where the crew's are busy (or off).
void run(ffi::ThreadPool& pool, const std::shared_ptr<Gang>& gang, int64_t items, int64_t work) {
  const int64_t most = work < kSoloWork ? 0 : std::max<int64_t>(pool.num_threads() - 1, 0);
  const int64_t helpers = std::min<int64_t>({most, items - 1, 255});
  Crew& crew = Crew::get();
  const int64_t posted =
      own_helpers.load(std::memory_order_relaxed) ? crew.post(gang.get(), helpers) : 0;
  for (int64_t t = posted; t < helpers; ++t) pool.Schedule([gang] { gang->help(); });
  gang->finish();
  crew.retract(gang.get(), helpers);
}

// At least n floats, not initialised, for the call this thread is making: the buffer is kept
// from call to call (it grows, never shrinks), one per kind of call. A vector made per call was
// zeroed every time and, from a few MiB (the hidden rows of a prefill), mapped fresh from the
// kernel. The expert call's holds its hidden and up rows (2 x rows x top-k x F floats: a
// 256-token prefill of top-8 experts with F = 2048 takes 32 MiB) and its packed inputs; the
// linear call's its packed inputs (kLinear); every thread of a call its results of a work item
// (kItemOut: the linear call's, the experts' down projections). No helper touches the
// caller's once the call has returned (Gang::finish).
enum class Scratch { kExperts, kLinear, kItemOut };

template <Scratch Kind>
float* scratch(int64_t n) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local int64_t size = 0;
  if (n > size) {
    buf.reset(new float[n]);
    size = n;
  }
  return buf.get();
}

// How many times their usual size the work items of a call whose rows stream from memory once
// may be (where: pairs.h's long_items). A core streams an item's rows as a few streams (rows a
// quarter of the item apart), which the prefetchers take up anew at each item: the longer the
// item, the nearer a plain read it streams, most where the memory is fast (docs/kernels.md,
// "Longer items at one pass"). Calls of several passes keep theirs, which their second pass
// finds in L2.
constexpr int64_t kLongItems = 4;

// Weight rows per work item: about `bytes` of weights, a multiple of 8 rows.
int64_t chunk_rows(int64_t row_bytes, int64_t rows, int64_t bytes) {
  const int64_t n = std::max<int64_t>(8, bytes / std::max<int64_t>(row_bytes, 1) / 8 * 8);
  return std::min(n, rows);
}

}  // namespace
