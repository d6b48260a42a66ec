// colibri_attend: decode attention of one new token per row, read straight from the KV
// cache.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "gang.h"
#include "simd.h"
#include "tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Decode attention, one new token per row, straight from the KV cache:
//   out[b, h] = softmax_t(scale * q[b, h] . k[slot_b, t, h / G]) . v[slot_b, t, h / G]
// over t = 0 .. pos[b] (the new token's own key is already in the cache). q [B, H, Dh],
// k and v [S, Hkv, C, Dh], slots and pos [B] int32 -> [B, H, Dh]; G = H / Hkv query heads
// share a KV head. Rows whose slot is outside [0, S) (batch padding) get zeros. One work item
// is one row's KV head: its keys and values, each one contiguous block, are read once for its
// G query heads.
struct AttendCall : Gang {
  const float *q, *k, *v;
  const int32_t *slot, *pos;
  float* out;
  int64_t B, H, Hkv, Dh, S, C;
  float scale;
  std::atomic<int64_t> next{0};

  // A work item's keys and values: n positions (0: a padding row, or no such item).
  struct Block {
    const float *k = nullptr, *v = nullptr;
    int64_t n = 0;
  };

  Block block(int64_t item) const {
    if (item >= B * Hkv) return {};
    const int64_t b = item / Hkv, s = slot[b];
    if (s < 0 || s >= S || pos[b] < 0) return {};
    const int64_t at = (s * Hkv + item % Hkv) * C * Dh;
    return {k + at, v + at, std::min<int64_t>(pos[b], C - 1) + 1};
  }

  // The most bytes of keys (and as many of values) of the next item fetched ahead.
  static constexpr int64_t kAhead = 64 << 10;

  // Positions [from, to) of a block's keys or values (rows of Dh floats) on their way to L2.
  static void fetch(const float* rows, int64_t from, int64_t to, int64_t Dh) {
    const char* p = reinterpret_cast<const char*>(rows);
    const int64_t row = Dh * static_cast<int64_t>(sizeof(float));
    for (int64_t c = from * row / 64 * 64; c < to * row; c += 64) __builtin_prefetch(p + c, 0, 2);
  }

  void drain() override {
    const int64_t G = H / Hkv, items = B * Hkv;
    std::vector<float> p;
    std::vector<const float*> qs(G);
    // Items are claimed one ahead, and the next one's keys and values, where they are short
    // (kAhead), are fetched as this one's are read, a position for a position: a core
    // otherwise computes an item and then waits on DRAM for the first rows of the next (short
    // streams, which the prefetchers start on late), its arithmetic and its reads one after
    // the other. Longer streams the prefetchers keep up with; fetching them too made a
    // long-context call slower.
    for (int64_t item = next.fetch_add(1, std::memory_order_relaxed); item < items;) {
      const int64_t following = next.fetch_add(1, std::memory_order_relaxed);
      const Block here = block(item);
      Block ahead = block(following);
      if (ahead.n * Dh * static_cast<int64_t>(sizeof(float)) > kAhead) ahead = {};
      const int64_t b = item / Hkv, g = item % Hkv, n = here.n;
      item = following;
      float* o = out + (b * H + g * G) * Dh;
      std::fill(o, o + G * Dh, 0.0f);
      if (n == 0) {
        fetch(ahead.k, 0, ahead.n, Dh);
        fetch(ahead.v, 0, ahead.n, Dh);
        continue;
      }
      for (int64_t j = 0; j < G; ++j) qs[j] = q + (b * H + g * G + j) * Dh;
      const int64_t ld = Dh;  // floats from one position's key to the next
      const int64_t np = (n + 7) / 8 * 8;  // score rows padded to whole vectors
      p.resize(G * np);
      matvecs(here.k, n, Dh, qs.data(), G,
              [&](int64_t t, int64_t j, float d) {
                p[j * np + t] = d;
                if (j == 0 && t < ahead.n) fetch(ahead.k, t, t + 1, Dh);
              },
              ld);
      fetch(ahead.k, n, ahead.n, Dh);
      for (int64_t j = 0; j < G; ++j) softmax(p.data() + j * np, n, np, scale);
      // o[j] = sum over t of p[j, t] * v[t], in order of t: per head, Dh floats at a time in
      // registers (the value rows are re-read from cache for each head of the group). The
      // first pass over the values fetches the next item's.
      int64_t fetching = std::min(n, ahead.n), fetched = 0;
      for (int64_t j = 0; j < G; ++j) {
        const float* pj = p.data() + j * np;
        float* oj = o + j * Dh;
        int64_t d0 = 0;
        for (; d0 + 64 <= Dh; d0 += 64, fetched += fetching, fetching = 0)
          accumulate<8>(pj, here.v + d0, ld, n, oj + d0, ahead.v, fetching, Dh);
        for (; d0 + 8 <= Dh; d0 += 8, fetched += fetching, fetching = 0)
          accumulate<1>(pj, here.v + d0, ld, n, oj + d0, ahead.v, fetching, Dh);
        for (; d0 < Dh; ++d0) {
          float acc = 0.0f;
          for (int64_t t = 0; t < n; ++t) acc = std::fma(pj[t], here.v[t * ld + d0], acc);
          oj[d0] = acc;
        }
      }
      fetch(ahead.v, fetched, ahead.n, Dh);
    }
  }

  // out[0 .. 8 * NV) = sum over t < n of p[t] * v[t * ld + ...], one FMA chain per lane; and
  // positions [0, ahead_n) of the block `ahead` (rows of Dh floats) fetched, one a position.
  // Not inlined: inside drain() GCC keeps acc in memory and stores all NV sums at every
  // position.
  template <int NV>
  __attribute__((noinline)) static void accumulate(const float* p, const float* v, int64_t ld,
                                                    int64_t n, float* out, const float* ahead,
                                                    int64_t ahead_n, int64_t Dh) {
    v8 acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = v8{};
    for (int64_t t = 0; t < n; ++t) {
      if (t < ahead_n) fetch(ahead, t, t + 1, Dh);
      const v8 w = v8{} + p[t];
      for (int i = 0; i < NV; ++i) acc[i] = fma8(w, load8(v + t * ld + 8 * i), acc[i]);
    }
    std::memcpy(out, acc, sizeof acc);
  }

  // s[0 .. n) <- softmax(scale * s) in place; s has room for np (a multiple of 8) floats.
  static void softmax(float* s, int64_t n, int64_t np, float scale) {
    std::fill(s + n, s + np, -INFINITY);
    const v8 sc = v8{} + scale;
    v8 mv = v8{} - INFINITY;
    for (int64_t t = 0; t < np; t += 8) mv = max8(mv, load8(s + t) * sc);
    float m = mv[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, mv[i]);
    const v8 mm = v8{} + m;
    v8 sum{};
    for (int64_t t = 0; t < np; t += 8) {
      const v8 e = exp8(load8(s + t) * sc - mm);
      std::memcpy(s + t, &e, sizeof e);
      sum += e;
    }
    const v8 inv = v8{} + 1.0f / hsum(sum);
    for (int64_t t = 0; t < np; t += 8) {
      const v8 e = load8(s + t) * inv;
      std::memcpy(s + t, &e, sizeof e);
    }
  }
};

// Attention over caches k, v (written already) into out: the shapes checked, the work run.
ffi::Error attend_into(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, const float* k,
                       const float* v, ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd,
                       ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> pos, float* out,
                       ffi::Span<const int64_t> od, float scale) {
  const auto qd = q.dimensions(), sd = slots.dimensions(), pd = pos.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || sd.size() != 1 || pd.size() != 1 ||
      od.size() != 3)
    return ffi::Error::InvalidArgument("colibri_attend: wrong ranks");
  const int64_t B = qd[0], H = qd[1], Dh = qd[2], S = kd[0], Hkv = kd[1], C = kd[2];
  if (kd[3] != Dh || vd[0] != S || vd[1] != Hkv || vd[2] != C || vd[3] != Dh || sd[0] != B ||
      pd[0] != B || od[0] != B || od[1] != H || od[2] != Dh || Hkv == 0 || H % Hkv != 0)
    return ffi::Error::InvalidArgument("colibri_attend: shapes disagree");
  auto call = std::make_shared<AttendCall>();
  call->q = q.typed_data();
  call->k = k;
  call->v = v;
  call->slot = slots.typed_data();
  call->pos = pos.typed_data();
  call->out = out;
  call->B = B;
  call->H = H;
  call->Hkv = Hkv;
  call->Dh = Dh;
  call->S = S;
  call->C = C;
  call->scale = scale;
  int64_t bytes = 0;  // keys and values read
  for (int64_t b = 0; b < B; ++b)
    if (call->slot[b] >= 0 && call->slot[b] < S && call->pos[b] >= 0)
      bytes += (std::min<int64_t>(call->pos[b], C - 1) + 1) * Hkv * Dh * 8;
  // Work: the keys and values once for each query head that reads them, as the linear
  // kernel counts a pass over its weights for every four inputs (a call whose bytes alone are
  // under kSoloWork, one row of a grouped-query model, costs several times their streaming).
  run(pool, call, B * Hkv, bytes * (H / Hkv));
  return ffi::Error::Success();
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slots,
                  ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out, float scale) {
  return attend_into(pool, q, k.typed_data(), v.typed_data(), k.dimensions(), v.dimensions(),
                     slots, pos, out->typed_data(), out->dimensions(), scale);
}

// colibri_attend_write: the new keys and values k_new, v_new [B, Hkv, Dh] written into the
// caches at (slots[b], pos[b]) (rows whose slot or position is outside the cache, negative
// ones too: not written), then colibri_attend over them. The caches come back as the second
// and third results, which the caller aliases to the second and third operands
// (kernels.attend_write): XLA then hands over the same memory, and only the new rows are
// written. Where it has not (a copy it made), the whole cache is copied over first: the
// results never depend on the aliasing.
ffi::Error AttendWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slots,
                       ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::F32> k_new,
                       ffi::Buffer<ffi::F32> v_new, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> k_out, ffi::ResultBuffer<ffi::F32> v_out,
                       float scale) {
  const auto kd = k.dimensions(), nd = k_new.dimensions(), qd = q.dimensions();
  if (kd.size() != 4 || nd.size() != 3 || qd.size() != 3 || !(k_out->dimensions() == kd) ||
      !(v_out->dimensions() == kd) || !(v.dimensions() == kd) || !(v_new.dimensions() == nd) ||
      slots.dimensions().size() != 1 || pos.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("colibri_attend_write: wrong ranks or shapes");
  const int64_t S = kd[0], Hkv = kd[1], C = kd[2], Dh = kd[3], B = nd[0];
  if (nd[1] != Hkv || nd[2] != Dh || qd[0] != B || slots.dimensions()[0] != B ||
      pos.dimensions()[0] != B)
    return ffi::Error::InvalidArgument("colibri_attend_write: shapes disagree");
  float* kc = k_out->typed_data();
  float* vc = v_out->typed_data();
  if (kc != k.typed_data()) std::memcpy(kc, k.typed_data(), k.size_bytes());
  if (vc != v.typed_data()) std::memcpy(vc, v.typed_data(), v.size_bytes());
  const int32_t *slot = slots.typed_data(), *at = pos.typed_data();
  for (int64_t b = 0; b < B; ++b) {
    if (slot[b] < 0 || slot[b] >= S || at[b] < 0 || at[b] >= C) continue;
    for (int64_t h = 0; h < Hkv; ++h) {
      const int64_t to = ((slot[b] * Hkv + h) * C + at[b]) * Dh, from = (b * Hkv + h) * Dh;
      std::memcpy(kc + to, k_new.typed_data() + from, sizeof(float) * Dh);
      std::memcpy(vc + to, v_new.typed_data() + from, sizeof(float) * Dh);
    }
  }
  return attend_into(pool, q, kc, vc, kd, kd, slots, pos, out->typed_data(), out->dimensions(),
                     scale);
}

}  // namespace
