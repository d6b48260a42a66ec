// How a call's work is shared out among XLA's intra-op threads: a Gang of the caller and the
// helpers it schedules, each taking work items until none is left.

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// COLIBRI_TRACE_CALLS=1 builds a library that times every call shared out among threads
// (experiments/call_trace.py); 0, the default, times nothing.
#ifndef COLIBRI_TRACE_CALLS
#define COLIBRI_TRACE_CALLS 0
#endif

namespace {

// Which kernel a call is (traced builds record it).
enum class CallKind : int64_t { kExperts = 1, kLinear, kHeads, kAttention, kLatentAttention };

// A traced call, in nanoseconds of the steady clock: run() entered (before the helpers are
// scheduled), the caller's own drain began (once they are), the first helper's drain began and
// the last one's ended (0: none joined), the caller's drain ended, and the call returned; its
// work (as `run` takes it), work items, threads, kernel (CallKind) and the helpers handed it
// as they waited for a call (`serve`), not scheduled.
struct CallRecord {
  int64_t enter, caller_start, helper_start, helper_end, caller_end, done, work, items, threads,
      kind, handed;
};
constexpr int64_t kTracedCalls = COLIBRI_TRACE_CALLS ? 1 << 16 : 1;  // the latest kept
constexpr int64_t kRecordFields = sizeof(CallRecord) / sizeof(int64_t);
CallRecord traced[kTracedCalls];
std::atomic<int64_t> traced_count{0};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
  int64_t threads = 1;            // the caller and the helpers run() schedules
  bool then_wait = false;         // whether its helpers wait for the next call (serve)
  CallRecord record{};            // traced builds: this call's times (written as it goes)
  std::atomic<int64_t> helper_start{0}, helper_end{0};

  virtual ~Gang() = default;
  virtual void drain() = 0;

  // A helper's share: items until none is left (none once the caller has closed the call);
  // then done(), before the caller can see this helper finished.
  template <typename Done>
  void help(Done done) {
    int64_t s = state.load(std::memory_order_relaxed);
    do {
      if (s & kClosed) return done();
    } while (!state.compare_exchange_weak(s, s + 1, std::memory_order_acquire));
    if constexpr (COLIBRI_TRACE_CALLS) {
      int64_t first = 0;
      helper_start.compare_exchange_strong(first, now_ns(), std::memory_order_relaxed);
    }
    drain();
    if constexpr (COLIBRI_TRACE_CALLS) helper_end.store(now_ns(), std::memory_order_relaxed);
    done();
    state.fetch_sub(1, std::memory_order_release);
  }

  void finish() {
    if constexpr (COLIBRI_TRACE_CALLS) record.caller_start = now_ns();
    drain();
    if constexpr (COLIBRI_TRACE_CALLS) record.caller_end = now_ns();
    state.fetch_or(kClosed, std::memory_order_acq_rel);
    wait_until([&] { return (state.load(std::memory_order_acquire) & ~kClosed) == 0; });
    if constexpr (COLIBRI_TRACE_CALLS) {
      record.helper_start = helper_start.load(std::memory_order_relaxed);
      record.helper_end = helper_end.load(std::memory_order_relaxed);
      record.done = now_ns();
      traced[traced_count.fetch_add(1, std::memory_order_relaxed) % kTracedCalls] = record;
    }
  }
};

// The calls traced since the last take, oldest first (at most kTracedCalls, the latest), into
// out (n records of CallRecord's ten fields): how many were written; -1 where the build
// does not trace. The caller stops the calls while it takes them.
int64_t take_traced(int64_t* out, int64_t n) {
  if (!COLIBRI_TRACE_CALLS) return -1;
  const int64_t count = traced_count.exchange(0, std::memory_order_relaxed);
  const int64_t kept = std::min({count, kTracedCalls, n});
  for (int64_t i = 0; i < kept; ++i) {
    const CallRecord& r = traced[(count - kept + i) % kTracedCalls];
    std::memcpy(out + i * kRecordFields, &r, sizeof r);
  }
  return kept;
}

// Calls with less work than this run on the caller alone: a helper costs more than it saves
// there, and takes the core the engine's thread starts the next forward on. Work: bytes of
// weights as float32 (or of keys and values) read, times the passes over them (one per tile
// of four inputs, or per query head).
constexpr int64_t kSoloWork = 512 << 10;

// Helpers that have done their share of a decode step's call wait a little for the next call
// (kLingerNs), which hands them its work, where a task of the pool would wake a thread the
// pool had put to sleep: between the shared calls of a 16-row step the XLA ops and the calls
// too small to share outlasted the pool's own spinning, and a call then spent up to 20 µs
// scheduling its helper, which began 15-25 µs after that (docs/kernels.md, "Helpers that wait
// for the next call, on the Xeon"). A prefill's calls (more than kWaitRows rows) leave their
// helpers to the pool at once: there XLA's own products of the longer chunks want its threads
// (a 128-token prefill took 1.2x the time with helpers waiting after every call). Builds for
// Intel cores (kernels.tuning()): on AMD Zen 5 helpers that waited 50 µs after one-row calls,
// bound there by the memory, left decode within its noise, and after every call made it 0.92x
// as fast.
// Never destroyed: a helper may still wait as the process ends.
struct Lingering {
  std::mutex m;
  std::vector<std::shared_ptr<Gang>> offered;  // calls handed over, one for each helper taken
  int64_t idle = 0;  // helpers waiting that no call has taken: waiting ones less offered ones
  std::atomic<int64_t> pending{0};  // offered.size(), read without the lock
};
inline Lingering& lingering() {
  static Lingering* const l = new Lingering;
  return *l;
}

// How long a helper waits for the next call before it goes back to the pool (0: it does not
// wait), and the most rows a call may have for its helpers to wait after it (a decode step's).
#ifndef COLIBRI_LINGER_NS
#define COLIBRI_LINGER_NS 0
#endif
constexpr int64_t kLingerNs = COLIBRI_LINGER_NS;
constexpr int64_t kWaitRows = 16;

// A helper: its share of `gang`, then of every call handed to it as it waits (spinning, and
// giving its core away every 64 spins: the thread that makes the next call may want it) until
// kLingerNs pass without one. It counts as waiting before its call can end, so that the
// caller's next call finds it. At most `most` helpers wait at once (the pool's threads less
// one, which XLA's own tasks keep).
inline void serve(std::shared_ptr<Gang> gang, int64_t most) {
  Lingering& l = lingering();
  while (gang) {
    bool waits = false;
    gang->help([&] {
      if (kLingerNs == 0 || !gang->then_wait) return;
      std::lock_guard<std::mutex> lock(l.m);
      waits = l.idle + static_cast<int64_t>(l.offered.size()) < most;
      l.idle += waits;
    });
    gang.reset();
    if (!waits) return;
    const int64_t until = now_ns() + kLingerNs;
    for (int spins = 1; !gang; ++spins) {
      const bool offer = l.pending.load(std::memory_order_acquire) > 0;
      if (offer || spins % 64 == 0) {
        const bool late = !offer && now_ns() > until;
        if (offer || late) {
          std::lock_guard<std::mutex> lock(l.m);
          if (!l.offered.empty()) {  // (each meant for a waiting helper: any of them)
            gang = std::move(l.offered.back());
            l.offered.pop_back();
            l.pending.store(static_cast<int64_t>(l.offered.size()), std::memory_order_release);
            continue;
          }
          if (late) {
            --l.idle;
            return;
          }
        }
        std::this_thread::yield();
      }
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
  }
}

// Run `gang`, a call of kernel `kind` over `rows` rows (tokens), on the caller and up to
// items - 1 helpers (none below kSoloWork): those waiting for a call first, then tasks of the
// pool.
void run(ffi::ThreadPool& pool, const std::shared_ptr<Gang>& gang, int64_t items, int64_t work,
         CallKind kind, int64_t rows) {
  const int64_t most = work < kSoloWork ? 0 : std::max<int64_t>(pool.num_threads() - 1, 0);
  const int64_t helpers = std::max<int64_t>(std::min<int64_t>(most, items - 1), 0);
  gang->threads = helpers + 1;
  gang->then_wait = rows <= kWaitRows;
  if constexpr (COLIBRI_TRACE_CALLS)
    gang->record = {now_ns(), 0, 0, 0, 0, 0, work, items, gang->threads, int64_t(kind), 0};
  int64_t handed = 0;
  if (kLingerNs > 0 && helpers > 0) {  // (none wait where helpers do not: no lock taken)
    Lingering& l = lingering();
    std::lock_guard<std::mutex> lock(l.m);
    handed = std::min(helpers, l.idle);
    l.idle -= handed;
    l.offered.insert(l.offered.end(), handed, gang);
    l.pending.store(static_cast<int64_t>(l.offered.size()), std::memory_order_release);
  }
  if constexpr (COLIBRI_TRACE_CALLS) gang->record.handed = handed;
  for (int64_t t = handed; t < helpers; ++t) pool.Schedule([gang, most] { serve(gang, most); });
  gang->finish();
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

// The buffer starts on a 64-byte boundary, as do the packed inputs in it (Packed::floats is a
// multiple of 16): a 512-bit load of them that straddled two cache lines took the 16-row
// tiles from L2 to 0.83x their rate at 16 bytes off, 0.65x at 32 (docs/kernels.md, "Packed
// inputs on a cache line").
template <Scratch Kind>
float* scratch(int64_t n) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local float* at = nullptr;
  thread_local int64_t size = 0;
  if (n > size) {
    buf.reset(new float[n + 16]);
    at = on_cache_line(buf.get());
    size = n;
  }
  return at;
}

// Results of a work item's n weight rows against `inputs` inputs: apply(emit) emits each
// (row o, input j, value) and store(o, j, value) puts it in place. Several inputs' go through
// this thread's buffer first, row after row, and are stored input by input at the end: an
// output's rows O floats apart, where O is a multiple of 1024 (4 KiB), put a tile's results for
// every input in one set of the L1 (lm_head of a vocabulary of 8192 at 16 rows: 1.2x the time
// of 8256 rows).
template <typename Apply, typename Store>
void through_item_buffer(int64_t n, int64_t inputs, Apply apply, Store store) {
  if (inputs == 1) {
    apply(store);
    return;
  }
  float* out = scratch<Scratch::kItemOut>(n * inputs);
  apply([&](int64_t o, int64_t j, float v) { out[o * inputs + j] = v; });
  for (int64_t j = 0; j < inputs; ++j)
    for (int64_t o = 0; o < n; ++o) store(o, j, out[o * inputs + j]);
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

// Rows a thread takes next where `left` rows of the call are not taken yet, by `threads`
// threads: `most` (the call's item) while much is left, then each thread's share of what is
// left (a multiple of 8 rows), but not under `least`. Long items leave the last thread
// computing alone for up to one of them: a one-row expert call's two threads ended ~25 µs
// apart in ~600 (docs/kernels.md, "Shorter takes toward the end").
inline int64_t guided_rows(int64_t left, int64_t threads, int64_t most, int64_t least) {
  const int64_t share = (left + threads - 1) / threads;
  const int64_t n = std::clamp((share + 7) / 8 * 8, std::min(least, most), most);
  return std::min(n, left);
}

}  // namespace
