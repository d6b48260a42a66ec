// colibri_moe_experts: the routed experts of a layer,
//   y[n, k] = down[s] @ (silu(gate[s] @ x[n]) * (up[s] @ x[n])),  s = ids[n, k]
//
// gate, up [S, F, D], down [S, D, F], x [N, D], ids [N, K] int32 -> y [N, K, D], float32.
// Entries of ids outside [0, S) are experts that are not staged: their rows of y are 0.
// colibri_moe_experts_bf16, _fp8, _int4, _int4z, _int8: the same over weights held in those
// formats (formats.h), widened as they are loaded; _bf16p: bfloat16 products (bf16p.h), the
// inputs and the hidden rows rounded to bfloat16 before the products that take them.
//
// Decode is bound by memory traffic: every weight row an expert owns is read once per call
// and multiplied against all the rows routed to that expert while it is in registers. The
// work is shared out among XLA's intra-op threads in slices of ~256-512 KiB of weights:
// first the hidden rows (gate and up) of every chosen expert, then their down projections.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16p.h"
#include "formats.h"
#include "gang.h"
#include "pairs.h"
#include "simd.h"
#include "tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

template <typename T>
struct Problem {
  const T* gate;
  const T* up;
  const T* down;
  float* y;
  int64_t F, D;
  int64_t ldg = 0, ldd = 0;  // row strides of gate/up and down, in T (D and F but for FP8)
  int64_t bg = 0, bd = 0;    // FP8 rows: block widths of gate/up and down
  std::vector<int32_t> slot;   // the distinct staged experts, most rows first
  std::vector<int64_t> first;  // their assignments: assign[first[i] .. first[i + 1])
  std::vector<int64_t> assign;
  std::vector<const float*> xrow;  // by sorted assignment: its input row
  std::vector<const float*> hrow;  // and its hidden row in h (experts not paired)
  // Bf16P: by sorted assignment, its input and its hidden row rounded to bfloat16.
  std::vector<const uint16_t*> xb, hb;
  float* h = nullptr;  // the hidden rows, expert by expert ([rows, F] each, or packed)
  float* u = nullptr;  // up projections, before the product, laid out as h
  // Per expert, where its rows go through the paired tiles (pairs.h): its inputs, hidden rows
  // and up projections packed (in the same scratch as h and u); r = 0 where they do not.
  std::vector<Packed> xp, hp, upp;
  int64_t fchunk, dchunk;          // weight rows per work item in each phase
  int64_t fitems, ditems;          // work items per expert in each phase
  int64_t dleast;                  // phase 2's shortest takes (guided_rows), in rows of down

  int64_t phase1() const { return static_cast<int64_t>(slot.size()) * fitems; }
  int64_t total() const { return static_cast<int64_t>(slot.size()) * (fitems + ditems); }

  // Phase 1, item (expert i, chunk c): h = silu(gate . x) * (up . x) over its share of F.
  // Bfloat16 products (never paired) then round the hidden rows for the down projection.
  void hidden(int64_t i, int64_t c) {
    const int64_t f0 = c * fchunk, nf = std::min(fchunk, F - f0), s = slot[i], q = first[i];
    const int64_t r = first[i + 1] - q;
    const T* G = gate + (s * F + f0) * ldg;
    const T* U = up + (s * F + f0) * ldg;
    if constexpr (!kProducts<T>) {
      if (hp[i].r) {
        const Packed &hx = hp[i], &ux = upp[i];
        matvecs(G, nf, D, xp[i], PackedOut{&hx, f0}, ldg, bg);
        matvecs(U, nf, D, xp[i], PackedOut{&ux, f0}, ldg, bg);
        // Chunks f0 / 8 .. of every group (f0 a multiple of 8), padding lanes included (zeros).
        const int64_t c0 = f0 / 8, nc = (f0 + nf + 7) / 8 - c0;
        for (int64_t g = 0; g < hx.groups(); ++g) {
          const int64_t n = hx.pairs(g) * 16;
          swiglu(hx.group(g) + c0 * n, ux.group(g) + c0 * n, nc * n);
        }
        return;
      }
    }
    const int64_t rows_at = hrow[q] - h;  // the expert's hidden rows, one after another
    float* hq = h + rows_at + f0;
    float* uq = u + rows_at + f0;
    auto to_h = [&](int64_t f, int64_t j, float v) { hq[j * F + f] = v; };
    auto to_u = [&](int64_t f, int64_t j, float v) { uq[j * F + f] = v; };
    if constexpr (kProducts<T>) {
      bmatvecs(G, nf, D, ldg, &xb[q], r, to_h);
      bmatvecs(U, nf, D, ldg, &xb[q], r, to_u);
    } else {
      matvecs(G, nf, D, &xrow[q], r, to_h, ldg, bg);
      matvecs(U, nf, D, &xrow[q], r, to_u, ldg, bg);
    }
    for (int64_t j = 0; j < r; ++j) {
      swiglu(hq + j * F, uq + j * F, nf);
      if constexpr (kProducts<T>)
        round_row(hq + j * F, nf, const_cast<uint16_t*>(hb[q + j]) + f0);
    }
  }

  // h[0 .. n) <- silu(h) * u, 8 lanes at a time (the tail too, so every element is computed
  // the same way wherever it falls).
  static void swiglu(float* h, const float* u, int64_t n) {
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
      const v8 y = silu8(load8(h + t)) * load8(u + t);
      std::memcpy(h + t, &y, sizeof y);
    }
    if (t < n) {
      v8 hv{}, uv{};
      std::memcpy(&hv, h + t, sizeof(float) * (n - t));
      std::memcpy(&uv, u + t, sizeof(float) * (n - t));
      const v8 y = silu8(hv) * uv;
      std::memcpy(h + t, &y, sizeof(float) * (n - t));
    }
  }

  // Phase 2, expert i's rows d0 .. d0 + nd of down: y = down . h over them.
  void output(int64_t i, int64_t d0, int64_t nd) {
    const int64_t s = slot[i], q = first[i];
    const int64_t r = first[i + 1] - q;
    const int64_t* a = assign.data() + q;
    const T* Dn = down + (s * D + d0) * ldd;
    auto apply = [&](auto emit) {
      if constexpr (kProducts<T>)
        bmatvecs(Dn, nd, F, ldd, &hb[q], r, emit);
      else if (hp[i].r)
        matvecs(Dn, nd, F, hp[i], emit, ldd, bd);
      else
        matvecs(Dn, nd, F, &hrow[q], r, emit, ldd, bd);
    };
    through_item_buffer(nd, r, apply,
                        [&](int64_t d, int64_t j, float v) { y[a[j] * D + d0 + d] = v; });
  }
};

// The expert call, in small items so that the threads finish together: every expert's
// phase-1 items, then every expert's phase-2 rows (each once its expert's phase 1 is done;
// the ends below meet experts whose phase 1 they did themselves first). The work of a
// phase is in expert order, most rows first; the first thread to arrive takes it from the
// front, the second from the back (and so on, alternating), until the two ends meet. While
// one thread computes on the weights of experts many rows chose, the other streams those of
// experts few rows chose, so that arithmetic and memory traffic overlap. Phase 2, the call's
// end, goes in takes of rows that shorten as the ends near each other (guided_rows).
template <typename T>
struct ExpertCall : Gang {
  Problem<T> p;
  // Per phase, taken from the front | from the back << 32: phase 1's items, phase 2's rows.
  std::atomic<int64_t> taken[2] = {0, 0};
  std::unique_ptr<std::atomic<int64_t>[]> hidden_done;  // per expert: phase-1 items done
  // Per paired expert: its inputs packed and its hidden and up rows' padding cleared (2), by
  // the first of its phase-1 items to start (1), or not yet (0).
  std::unique_ptr<std::atomic<int>[]> packed;
  std::atomic<int64_t> arrivals{0};

  void drain() override {
    [[maybe_unused]] std::conditional_t<
        kScaled<T>, KeepSubnormals, std::conditional_t<kProducts<T>, FlushSubnormals, int>>
        keep{};
    const bool back = arrivals.fetch_add(1, std::memory_order_relaxed) % 2 == 1;
    const int64_t n1 = p.phase1();
    for (int64_t k; (k = take(taken[0], n1, back)) >= 0;) {
      const int64_t e = k / p.fitems;
      if (p.xp[e].r) pack(e);
      p.hidden(e, k % p.fitems);
      hidden_done[e].fetch_add(1, std::memory_order_release);
    }
    // An expert's phase-2 rows wait for its own hidden rows only, not for the other thread's
    // last phase-1 item.
    for (int64_t e, d0, nd; take_rows(back, e, d0, nd);) {
      wait_until([&] { return hidden_done[e].load(std::memory_order_acquire) >= p.fitems; });
      p.output(e, d0, nd);
    }
  }

  // Phase 2's next rows from the front (or the back) of every expert's D rows in turn: expert
  // e's rows d0 .. d0 + nd, within one expert; false once the ends have met.
  bool take_rows(bool back, int64_t& e, int64_t& d0, int64_t& nd) {
    const int64_t D = p.D, n = static_cast<int64_t>(p.slot.size()) * D;
    int64_t s = taken[1].load(std::memory_order_relaxed), next;
    do {
      const int64_t front = s & 0xffffffff, from_back = s >> 32, left = n - front - from_back;
      if (left <= 0) return false;
      const int64_t most = guided_rows(left, threads, p.dchunk, p.dleast);
      if (back) {
        const int64_t end = n - from_back;  // rows [.., end) of the experts in turn
        e = (end - 1) / D;
        nd = std::min(most, end - e * D);
        d0 = end - e * D - nd;
        next = s + (nd << 32);
      } else {
        e = front / D;
        d0 = front - e * D;
        nd = std::min(most, D - d0);
        next = s + nd;
      }
    } while (!taken[1].compare_exchange_weak(s, next, std::memory_order_relaxed));
    return true;
  }

  // Expert i's inputs packed for the paired tiles, by this thread unless another is at it.
  // Packed in the work items rather than by the caller before the helpers start, both threads
  // pack while they stream (docs/kernels.md, "Inputs packed in the items").
  void pack(int64_t i) {
    int state = 0;
    if (packed[i].compare_exchange_strong(state, 1, std::memory_order_acquire)) {
      p.xp[i].pack(&p.xrow[p.first[i]]);
      p.hp[i].clear_padding();
      p.upp[i].clear_padding();
      packed[i].store(2, std::memory_order_release);
    } else if (state != 2) {
      wait_until([&] { return packed[i].load(std::memory_order_acquire) == 2; });
    }
  }

  // The next of n items from the front (or the back); -1 once the ends have met.
  static int64_t take(std::atomic<int64_t>& ends, int64_t n, bool back) {
    int64_t s = ends.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = s & 0xffffffff, from_back = s >> 32;
      if (front + from_back >= n) return -1;
      const int64_t next = back ? s + (int64_t{1} << 32) : s + 1;
      if (ends.compare_exchange_weak(s, next, std::memory_order_relaxed))
        return back ? n - 1 - from_back : front;
    }
  }
};

// The expert call over weights of element type T (float, uint16_t: bfloat16 bits, uint8_t:
// FP8 rows, Int4: int4 rows, Int4Z: int4 rows with zero points, Int8Z: int8 rows).
template <ffi::DataType WT, typename T>
ffi::Error MoeExperts(ffi::ThreadPool pool, ffi::Buffer<WT> gate, ffi::Buffer<WT> up,
                      ffi::Buffer<WT> down, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                      ffi::ResultBuffer<ffi::F32> y) {
  const auto gd = gate.dimensions(), ud = up.dimensions(), dd = down.dimensions();
  const auto xd = x.dimensions(), id = ids.dimensions(), yd = y->dimensions();
  if (gd.size() != 3 || ud.size() != 3 || dd.size() != 3 || xd.size() != 2 || id.size() != 2 ||
      yd.size() != 3)
    return ffi::Error::InvalidArgument("colibri_moe_experts: wrong ranks");
  const int64_t S = gd[0], F = gd[1], D = xd[1], N = xd[0], K = id[1];
  // Row lengths as held, in T (Int4Z and Int8Z rows come in 32-bit words: four T a word).
  const int64_t unit = sizeof(*gate.typed_data()) / sizeof(T);
  const int64_t ldg = gd[2] * unit, ldd = dd[2] * unit;
  if (ud[0] != S || ud[1] != F || ud[2] != gd[2] || dd[0] != S || dd[1] != D || id[0] != N ||
      yd[0] != N || yd[1] != K || yd[2] != D)
    return ffi::Error::InvalidArgument("colibri_moe_experts: shapes disagree");
  int64_t bg = 0, bd = 0;
  if constexpr (kScaled<T>) {  // rows of L values and L / b scales
    const T* kind = nullptr;
    bg = scale_width(kind, D, ldg);
    bd = scale_width(kind, F, ldd);
    if (bg == 0 || bd == 0)
      return ffi::Error::InvalidArgument(
          "colibri_moe_experts_fp8/int4/int8: rows are not L values and L / b scales (and "
          "offsets), b of 8");
  } else if (ldg != D || ldd != F) {
    return ffi::Error::InvalidArgument("colibri_moe_experts: shapes disagree");
  }

  auto call = std::make_shared<ExpertCall<T>>();
  Problem<T>& p = call->p;
  p.gate = reinterpret_cast<const T*>(gate.typed_data());
  p.up = reinterpret_cast<const T*>(up.typed_data());
  p.down = reinterpret_cast<const T*>(down.typed_data());
  p.y = y->typed_data();
  p.F = F;
  p.D = D;
  p.ldg = ldg;
  p.ldd = ldd;
  p.bg = bg;
  p.bd = bd;
  const int32_t* sid = ids.typed_data();
  const int64_t NK = N * K;

  // Counting sort of the assignments by expert; unstaged ones get zero rows.
  std::vector<int64_t> count(S + 1, 0);
  for (int64_t a = 0; a < NK; ++a) {
    const int32_t s = sid[a];
    if (s >= 0 && s < S) {
      ++count[s];
    } else {
      std::memset(p.y + a * D, 0, sizeof(float) * D);
    }
  }
  std::vector<int32_t> used;
  for (int32_t s = 0; s < S; ++s)
    if (count[s]) used.push_back(s);
  std::stable_sort(used.begin(), used.end(),
                   [&](int32_t a, int32_t b) { return count[a] > count[b]; });
  std::vector<int64_t> at(S, 0);
  p.first.push_back(0);
  for (int32_t s : used) {
    at[s] = p.first.back();
    p.first.push_back(p.first.back() + count[s]);
  }
  p.assign.resize(p.first.back());
  for (int64_t a = 0; a < NK; ++a) {
    const int32_t s = sid[a];
    if (s >= 0 && s < S) p.assign[at[s]++] = a;
  }
  p.slot = std::move(used);
  const int64_t staged = p.first.back(), experts = static_cast<int64_t>(p.slot.size());
  // Scratch: every expert's hidden rows, then its up projections, then (paired) its inputs.
  std::vector<int64_t> hoff(experts + 1, 0), xoff(experts + 1, 0);
  for (int64_t i = 0; i < experts; ++i) {
    const int64_t r = p.first[i + 1] - p.first[i];
    const bool paired = kPairs && !kProducts<T> && r >= kPairedFrom;
    hoff[i + 1] = hoff[i] + (paired ? Packed::floats(r, F) : r * F);
    xoff[i + 1] = xoff[i] + (paired ? Packed::floats(r, D) : 0);
  }
  // Bf16P: then the inputs and the hidden rows rounded to bfloat16 (two to a float).
  const int64_t halves = kProducts<T> ? N * D + staged * F : 0;
  p.h = scratch<Scratch::kExperts>(2 * hoff[experts] + xoff[experts] + (halves + 1) / 2);
  p.u = p.h + hoff[experts];
  float* xs = p.u + hoff[experts];
  uint16_t* xbf = reinterpret_cast<uint16_t*>(xs + xoff[experts]);
  uint16_t* hbf = xbf + N * D;
  if constexpr (kProducts<T>) {
    for (int64_t n = 0; n < N; ++n) round_row(x.typed_data() + n * D, D, xbf + n * D);
    p.xb.resize(staged);
    p.hb.resize(staged);
  }
  p.xrow.resize(staged);
  p.hrow.resize(staged);
  p.xp.assign(experts, {});
  p.hp.assign(experts, {});
  p.upp.assign(experts, {});
  for (int64_t i = 0; i < experts; ++i) {
    const int64_t q0 = p.first[i], r = p.first[i + 1] - q0;
    for (int64_t q = q0; q < q0 + r; ++q) {
      p.xrow[q] = x.typed_data() + (p.assign[q] / K) * D;
      p.hrow[q] = p.h + hoff[i] + (q - q0) * F;
      if constexpr (kProducts<T>) {
        p.xb[q] = xbf + (p.assign[q] / K) * D;
        p.hb[q] = hbf + q * F;
      }
    }
    if (xoff[i + 1] > xoff[i]) {
      p.xp[i] = Packed(xs + xoff[i], r, D);  // packed by the expert's first item (pack)
      p.hp[i] = Packed(p.h + hoff[i], r, F);
      p.upp[i] = Packed(p.u + hoff[i], r, F);
    }
  }
  // Slices of 512 KiB (gate and up) and 256 KiB (down): halves of these were slower. Where a
  // phase's rows stream once for every expert (pairs.h's long_items), kLongItems times that,
  // while it leaves every thread four items or more.
  const T* kind = nullptr;  // bytes of weights (their scales aside, for FP8 and int4):
  const int64_t most = experts ? p.first[1] - p.first[0] : 0;  // most rows first
  const auto slice = [&](bool long_f, bool long_d) {
    p.fchunk = chunk_rows(2 * value_bytes(kind, D), F, (long_f ? kLongItems : 1) * (512 << 10));
    p.dchunk = chunk_rows(value_bytes(kind, F), D, (long_d ? kLongItems : 1) * (256 << 10));
    p.fitems = (F + p.fchunk - 1) / p.fchunk;
    p.ditems = (D + p.dchunk - 1) / p.dchunk;
    // Long items end in takes down to a quarter of the usual item; others keep theirs.
    p.dleast = long_d ? chunk_rows(value_bytes(kind, F), D, 64 << 10) : p.dchunk;
  };
  slice(long_items(kind, most, D), long_items(kind, most, F));
  if (experts * p.fitems < 4 * std::max<int64_t>(pool.num_threads(), 1)) slice(false, false);

  call->hidden_done.reset(new std::atomic<int64_t>[experts]());
  call->packed.reset(new std::atomic<int>[experts]());
  const int64_t passes = experts ? (staged / experts + 3) / 4 : 1;  // tiles of 4 rows each
  run(pool, call, p.total(), experts * 3 * F * value_bytes(kind, D) * passes,
      CallKind::kExperts, N);
  return ffi::Error::Success();
}

}  // namespace
