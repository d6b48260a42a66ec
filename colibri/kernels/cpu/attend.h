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
#include "pairs.h"
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
// is one row's KV head: its keys and values, each one contiguous block, are read from memory
// once for its G query heads (the scores in `scores`' tiles, the weighted values in `values`',
// which load each position's values once for several heads). Rows that follow one another in
// a slot (a prefill's tokens, a row each: pos one more than the row before's) share items, up
// to `group_rows` of them: their m G heads meet the keys and values once, each head's scores
// and sums taken over its own row's positions only, so that every row's result is bitwise
// what it gets alone.
struct AttendCall : Gang {
  const float *q, *k, *v;
  const int32_t *slot, *pos;
  float* out;
  int64_t B, H, Hkv, Dh, S, C;
  float scale;
  // Multi-head latent attention (colibri_mla_attend): the cache's heads (1: every group of
  // query heads reads the one latent cache, k = v), each score plus the query's roped part
  // `qr` [B, H, R] against the roped keys `kr` [S, C, R], and the positions a row keeps
  // (`keep` [B, keep_len], 0: not kept, scored -inf; none where keep_len is 0).
  int64_t cache_heads = 0;  // 0: Hkv
  const float *qr = nullptr, *kr = nullptr;
  int64_t R = 0;
  const uint8_t* keep = nullptr;
  int64_t keep_len = 0;
  // Whether a thread claims its next item as it starts one (to fetch that item's keys and
  // values as it goes): as many items as threads would otherwise go two to one thread.
  bool claim_ahead = true;
  std::vector<int64_t> first;  // the rows of item group i: first[i] .. first[i + 1]
  std::atomic<int64_t> next{0};

  // Rows an item may hold: about sixteen query heads (two groups of the paired tiles); MLA's
  // one (latent_item).
  int64_t group_rows(int64_t G) const { return cache_heads ? 1 : std::max<int64_t>(1, 16 / G); }

  // Rows b in groups: each row with the one before it where they share a slot in the cache
  // and b's position is the next one (rows of no slot, padding, each alone: zeros in place).
  void group() {
    const int64_t most = group_rows(H / Hkv);
    first.assign(1, 0);
    for (int64_t b = 1; b < B; ++b) {
      const bool follows = slot[b] == slot[b - 1] && slot[b] >= 0 && slot[b] < S &&
                           pos[b] == pos[b - 1] + 1 && pos[b - 1] >= 0;
      if (!follows || b - first.back() >= most) first.push_back(b);
    }
    first.push_back(B);
  }
  int64_t items() const { return (static_cast<int64_t>(first.size()) - 1) * Hkv; }

  // Positions row b reads (0: a padding row).
  int64_t positions(int64_t b) const {
    if (slot[b] < 0 || slot[b] >= S || pos[b] < 0) return 0;
    return std::min<int64_t>(pos[b], C - 1) + 1;
  }

  // A work item's keys and values: n positions, its last row's (0: padding rows, or no such
  // item).
  struct Block {
    const float *k = nullptr, *v = nullptr;
    int64_t n = 0;
  };

  Block block(int64_t item) const {
    if (item < 0 || item >= items()) return {};
    const int64_t last = first[item / Hkv + 1] - 1, n = positions(last);
    if (n == 0) return {};
    const int64_t ch = cache_heads ? cache_heads : Hkv;
    const int64_t at = (slot[last] * ch + item % Hkv % ch) * C * Dh;
    return {k + at, v + at, n};
  }

  // The most bytes of keys (and as many of values) of the next item fetched ahead.
  static constexpr int64_t kAhead = 64 << 10;

  // Positions [from, to) of a block's keys or values (rows of Dh floats) on their way to L2.
  static void fetch(const float* rows, int64_t from, int64_t to, int64_t Dh) {
    const char* p = reinterpret_cast<const char*>(rows);
    const int64_t row = Dh * static_cast<int64_t>(sizeof(float));
    for (int64_t c = from * row / 64 * 64; c < to * row; c += 64) __builtin_prefetch(p + c, 0, 2);
  }

  // Positions fetched ahead within an item (keys as the tiles go, the values' first ones before
  // the softmax, a long next item's first keys): about 16 KiB of them. Long items are
  // otherwise left to the prefetchers, which kept a core waiting on DRAM at each new stream
  // and fell behind the score tiles (grouped-query heads of 64 columns at 2048 positions:
  // 0.88x the time with them).
  static int64_t lead_rows(int64_t Dh) { return std::max<int64_t>(16, (16 << 10) / (Dh * 4)); }

  // Rows [.., n) of the next item's keys or values (of Dh floats), fetched as a tile goes.
  struct Ahead {
    const float* rows;
    int64_t n, Dh;
  };

  void drain() override {
    const int64_t G = H / Hkv, items = this->items();
    std::vector<float> p, packed, sums;
    std::vector<const float*> qs, qrs;
    const auto claim = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
    // Items are claimed one ahead (claim_ahead), and the next one's keys and values, where
    // they are short (kAhead), are fetched as this one's are read, a position for a position:
    // a core otherwise computes an item and then waits on DRAM for the first rows of the next
    // (short streams, which the prefetchers start on late), its arithmetic and its reads one
    // after the other. Longer ones are fetched lead_rows ahead only (fetching them whole made
    // a long-context call slower).
    for (int64_t item = claim(); item < items; item = item >= 0 ? item : claim()) {
      const int64_t following = claim_ahead ? claim() : -1;
      const Block here = block(item);
      Block ahead = block(following);
      const Block after = ahead;
      if (ahead.n * Dh * static_cast<int64_t>(sizeof(float)) > kAhead) ahead = {};
      const int64_t b = first[item / Hkv], rows = first[item / Hkv + 1] - b, g = item % Hkv;
      const int64_t n = here.n, heads = rows * G;
      item = following;
      // One row's heads are written in place; several rows' are summed in `sums`, then copied.
      float* o = out + (b * H + g * G) * Dh;
      if (rows > 1) {
        sums.resize(heads * Dh);
        o = sums.data();
      }
      std::fill(o, o + heads * Dh, 0.0f);
      if (n == 0) {
        fetch(ahead.k, 0, ahead.n, Dh);
        fetch(ahead.v, 0, ahead.n, Dh);
        continue;
      }
      qs.resize(heads);
      for (int64_t j = 0; j < heads; ++j) qs[j] = q + ((b + j / G) * H + g * G + j % G) * Dh;
      if (kr) {  // (one row an item: MlaAttend)
        latent_item(b, g, heads, here.k, n, o, qs, qrs, p, packed);
        continue;
      }
      // Score rows padded to whole 512-bit vectors, and off a multiple of 256 floats: rows a
      // power of two bytes apart put every head's probabilities of a position in one set of
      // the L1.
      const int64_t np = (n + 15) / 16 * 16 + ((n + 15) / 16 * 16 % 256 == 0 ? 16 : 0);
      p.resize(heads * np);
      scores(here.k, here.v, n, Dh, qs.data(), heads, p.data(), np, {ahead.k, ahead.n, Dh},
             packed);
      fetch(ahead.k, n, ahead.n, Dh);
      const int64_t lead = lead_rows(Dh);
      fetch(here.v, 0, std::min(n, lead), Dh);
      if (ahead.n == 0) fetch(after.k, 0, std::min(after.n, lead), Dh);
      const int64_t n0 = positions(b);  // the first row's positions: every row reads them
      for (int64_t j = 0; j < heads; ++j)
        softmax(p.data() + j * np, positions(b + j / G), scale);
      values(p.data(), np, here.v, 0, n0, Dh, heads, o, ahead.v, ahead.n);
      if (rows == 1) continue;
      for (int64_t r = 1; r < rows; ++r)  // each later row's own last positions, in order
        values(p.data() + r * G * np, np, here.v, n0, positions(b + r), Dh, G, o + r * G * Dh,
               nullptr, 0);
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out + ((b + r) * H + g * G) * Dh, o + r * G * Dh, sizeof(float) * G * Dh);
    }
  }

  // Positions a chunk of MLA's attention (latent_item): 590 KiB of latents and roped keys at
  // DeepSeek-V3's widths, in L2 from their scores to their values.
  static constexpr int64_t kChunk = 256;

  // MLA's work item: one row's heads (from b's head g G on) over its n latents `lat`, into o
  // (zeros), the positions chunk by chunk of kChunk from the first (flash attention's online
  // softmax): each chunk's scores (latent_scores, the positions DSA's selection drops -inf),
  // every head's running maximum M of scale times its scores so far and the sum l of their
  // e^(x - M), o and l rescaled by e^(M_before - M) where a chunk raised M, then o advanced
  // over the chunk's latents weighed by e^(x_t - M) (`values`: every sum one multiply-add chain
  // in order of position); at the end o / l. A chunk's latents are read from memory once, for
  // its scores, and again from L2 for its values: a softmax over all the positions first read
  // them twice from memory, the second time past L2 from about 900 positions on (DeepSeek-V3's
  // widths), 2x the bytes of a long context. The chunks are the same for a row alone and
  // among others, so its bits are.
  void latent_item(int64_t b, int64_t g, int64_t heads, const float* lat, int64_t n, float* o,
                   std::vector<const float*>& qs, std::vector<const float*>& qrs,
                   std::vector<float>& p, std::vector<float>& packed) const {
    const int64_t np = kChunk + 16;  // (rows of probabilities off a power of two bytes apart)
    p.resize(heads * np);
    thread_local std::vector<float> state;
    state.assign(3 * heads, 0.0f);
    float *M = state.data(), *l = M + heads, *alpha = l + heads;
    std::fill(M, M + heads, -INFINITY);
    const float* keys = kr + slot[b] * C * R;
    for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
      const int64_t m = std::min(kChunk, n - t0);
      latent_scores(b, g, heads, lat + t0 * Dh, keys + t0 * R, m, qs, qrs, p.data(), np,
                    packed);
      if (keep && t0 < keep_len) {
        const uint8_t* kept = keep + b * keep_len + t0;
        for (int64_t j = 0; j < heads; ++j)
          for (int64_t t = 0; t < std::min(m, keep_len - t0); ++t)
            if (!kept[t]) p[j * np + t] = -INFINITY;
      }
      bool rescale = false;
      for (int64_t j = 0; j < heads; ++j) {
        alpha[j] = online_softmax(p.data() + j * np, m, scale, M[j], l[j]);
        rescale |= alpha[j] != 1.0f;
      }
      if (rescale)
        for (int64_t j = 0; j < heads; ++j)
          if (alpha[j] != 1.0f)
            for (int64_t d = 0; d < Dh; ++d) o[j * Dh + d] *= alpha[j];
      values(p.data(), np, lat + t0 * Dh, 0, m, Dh, heads, o, nullptr, 0);
    }
    for (int64_t j = 0; j < heads; ++j) {
      const float inv = l[j] > 0 ? 1.0f / l[j] : 0.0f;  // (no position kept: zeros)
      for (int64_t d = 0; d < Dh; ++d) o[j * Dh + d] *= inv;
    }
  }

  // One head's chunk of scores s[0 .. m) made e^(scale s_t - M') in place (s has room for m
  // rounded up to 16 floats), where M' is the larger of its running maximum M and the chunk's
  // maximum of scale s_t, M and l (the sum of e^(x - M) so far, in eight lanes in order of
  // position, then the fixed horizontal sum, added to l e^(M - M')) brought up to M': returns
  // e^(M - M'), the factor for the sums so far (1 where M' is M; 0 where M was -inf). A chunk
  // of dropped positions only (-inf): zeros, M and l as they were. AVX-512 builds take e^x
  // sixteen lanes at a time, the same values (simd.h's exp_lanes), and add their two halves
  // in turn.
  static float online_softmax(float* s, int64_t m, float scale, float& M, float& l) {
    const int64_t mp = (m + 15) / 16 * 16;
    std::fill(s + m, s + mp, -INFINITY);
    const v8 sc = v8{} + scale;
    v8 mv = v8{} - INFINITY;
    for (int64_t t = 0; t < mp; t += 8) mv = max8(mv, load8(s + t) * sc);
    float mc = mv[0];
    for (int i = 1; i < 8; ++i) mc = std::max(mc, mv[i]);
    const float top = std::max(M, mc);
    if (top == -INFINITY) {  // nothing kept yet
      std::fill(s, s + mp, 0.0f);
      return 1.0f;
    }
    const v8 mm = v8{} + top;
    v8 sum{};
    int64_t t = 0;
#if defined(__AVX512F__)
    for (; t + 16 <= mp; t += 16) {
      const v16 e = exp_lanes(load16(s + t) * (v16{} + scale) - (v16{} + top));
      std::memcpy(s + t, &e, sizeof e);
      sum += load8(s + t);
      sum += load8(s + t + 8);
    }
#endif
    for (; t < mp; t += 8) {
      const v8 e = exp8(load8(s + t) * sc - mm);
      std::memcpy(s + t, &e, sizeof e);
      sum += e;
    }
    const float alpha = M == top ? 1.0f : exp8(v8{} + (M - top))[0];
    l = l * alpha + hsum(sum);
    M = top;
    return alpha;
  }

  // MLA: s[j * ns + t] = [q_j | qr_j] . [lat_t | kr_t], each score one dot product over the
  // r + R columns of a latent and its roped key (one 8-lane sum over the latent's columns and
  // on over the roped key's, then the fixed horizontal sum), for the item's heads (row b's,
  // group g) and n latents `lat` and their roped keys `keys`. AVX-512 builds: the
  // heads packed, the latents in key_blocks' blocks; others in tiles of three latents and
  // four heads (tiles.h's steps): the same bits. (Two dot products and their sum spent 0.83
  // ms of a 5.35 ms call on the roped keys' 64 columns, 16 rows of 32 heads at 1024 positions:
  // as many horizontal sums and stores as the latents' 512 columns, for an eighth the work.)
  void latent_scores(int64_t b, int64_t g, int64_t heads, const float* lat, const float* roped,
                     int64_t n, std::vector<const float*>& qs, std::vector<const float*>& qrs,
                     float* s, int64_t ns, std::vector<float>& packed) const {
    const int64_t G = H / Hkv;
    const KeyRows keys{lat, Dh, roped, R};
    qrs.resize(heads);
    for (int64_t j = 0; j < heads; ++j) qrs[j] = qr + (b * H + g * G + j) * R;
    auto emit = [&](int64_t t, int64_t j, float d) { s[j * ns + t] = d; };
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    const Packed x(aligned_floats(packed, Packed::floats(heads, Dh + R)), heads, Dh + R);
    for (int64_t j = 0; j < heads; ++j) {  // (Dh and R are multiples of 8: MlaAttend)
      for (int64_t c = 0; c < Dh; c += 8) std::memcpy(x.at(j, c), qs[j] + c, sizeof(float) * 8);
      for (int64_t c = 0; c < R; c += 8)
        std::memcpy(x.at(j, Dh + c), qrs[j] + c, sizeof(float) * 8);
    }
    x.clear_padding();
    key_blocks(keys, nullptr, n, x, emit, Ahead{nullptr, 0, Dh});
#else
    (void)packed;
    int64_t t = 0;
    for (; t + 3 <= n; t += 3) latent_tiles<3>(keys, t, qs.data(), qrs.data(), heads, emit);
    for (; t < n; ++t) latent_tiles<1>(keys, t, qs.data(), qrs.data(), heads, emit);
#endif
  }

  // Keys as the score tiles read them: rows of `ld` floats from k and, where k2 is given (MLA's
  // roped keys), each key's columns going on in a row of ld2 floats from k2.
  struct KeyRows {
    const float* k;
    int64_t ld;
    const float* k2 = nullptr;
    int64_t ld2 = 0;
  };

  // latent_scores' tiles where the build has no paired ones: keys t .. t + TW against the
  // heads four at a time, the first four's tile fetching the next TW latents into L2 as it
  // goes (without it the tiles waited on them: AVX2 builds 0.77-0.85x the time so; fetched
  // two tiles ahead the same; every four heads over a block of 48 keys instead of the heads
  // over three keys at a time, 0.96-1.02x).
  template <int TW, typename Emit>
  static void latent_tiles(const KeyRows& keys, int64_t t, const float* const* qs,
                           const float* const* qrs, int64_t heads, Emit& emit) {
    int64_t j = 0;
    for (; j + 4 <= heads; j += 4)
      latent_tile<TW, 4>(keys, t, qs + j, qrs + j, j, emit, j == 0 ? TW : 0);
    switch (heads - j) {
      case 3:
        return latent_tile<TW, 3>(keys, t, qs + j, qrs + j, j, emit);
      case 2:
        return latent_tile<TW, 2>(keys, t, qs + j, qrs + j, j, emit);
      case 1:
        return latent_tile<TW, 1>(keys, t, qs + j, qrs + j, j, emit);
    }
  }

  // One tile: its keys' latents `ahead` keys on (none where 0) fetched a line a step.
  template <int TW, int TR, typename Emit>
  static void latent_tile(const KeyRows& keys, int64_t t, const float* const* qs,
                          const float* const* qrs, int64_t j0, Emit& emit, int64_t ahead = 0) {
    const float *w[TW], *w2[TW];
    for (int i = 0; i < TW; ++i) {
      w[i] = keys.k + (t + i) * keys.ld;
      w2[i] = keys.k2 + (t + i) * keys.ld2;
    }
    v8 acc[TW][TR];
    for (int i = 0; i < TW; ++i)
      for (int r = 0; r < TR; ++r) acc[i][r] = v8{};
    for (int64_t c = 0; c < keys.ld; c += 8) {
      if (ahead && c % 16 == 0)
        for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + ahead * keys.ld + c, 0, 2);
      step(w, qs, c, acc, std::make_index_sequence<TW>{});
    }
    for (int64_t c = 0; c < keys.ld2; c += 8)
      step(w2, qrs, c, acc, std::make_index_sequence<TW>{});
    float out[TW * TR];
    hsums<TW * TR>(&acc[0][0], out);
    for (int i = 0; i < TW; ++i)
      for (int r = 0; r < TR; ++r) emit(t + i, j0 + r, out[i * TR + r]);
  }

  // s[j * ns + t] = q[j] . k[t] for the n keys of a block (rows of Dh floats) and G query
  // heads, and the next item's keys fetched a key a key (`next`): tiles.h's matvecs; in
  // AVX-512 builds one to four heads meet the keys a pair at a time (key_pair_scores), and
  // more than four the paired tiles over the heads packed once (into `packed`, kept from
  // item to item), three keys a tile, every head a pass over them, the keys lead_rows ahead
  // fetched as they go, and the next item's keys and a long item's values (v) a line a row as
  // the tile goes (pair_dots' Fetch; the arithmetic of those tiles leaves a core's reads idle:
  // 0.88-0.94x the time at 512 and 2048 positions). The same sums either way (cpu.cc,
  // "Exactness").
  static void scores(const float* k, const float* v, int64_t n, int64_t Dh,
                     const float* const* qs, int64_t G, float* s, int64_t ns, const Ahead& next,
                     std::vector<float>& packed) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)  // (kPairs: pairs.h's tiles are there)
    if (G > 4) {
      const Packed x(aligned_floats(packed, Packed::floats(G, Dh)), G, Dh);
      x.pack(qs);
      auto emit = [&](int64_t t, int64_t j, float d) { s[j * ns + t] = d; };
      if (x.groups() > 1) return key_blocks({k, Dh}, v, n, x, emit, next);
      const int64_t lead = lead_rows(Dh);
      // The values too, as many as half an L2 takes, where no item before fetched them.
      const int64_t vrows = n * Dh * 4 > kAhead ? (512 << 10) / (Dh * 4) : 0;
      int64_t t = 0;
      for (; t + 3 <= n; t += 3) {
        if (t + lead < n) fetch(k, t + lead, std::min(t + lead + 3, n), Dh);
        const float* w[3] = {k + t * Dh, k + (t + 1) * Dh, k + (t + 2) * Dh};
        const int64_t rows[3] = {t, t + 1, t + 2};
        const float* f0 = t + 3 <= next.n ? next.rows + t * Dh : nullptr;
        const float* f1 = t + 3 <= vrows ? v + t * Dh : nullptr;
        if (!f0 && t < next.n) fetch(next.rows, t, std::min(t + 3, next.n), Dh);
        if (!f1 && t < vrows) fetch(v, t, std::min({t + 3, n, vrows}), Dh);
        pair_tiles<3, true>(w, rows, x, emit, 0, x.groups(), f0, f1);
      }
      for (; t < n; ++t) {
        if (t < next.n) fetch(next.rows, t, t + 1, Dh);
        const float* w[1] = {k + t * Dh};
        pair_tiles<1>(w, &t, x, emit, 0, x.groups());
      }
      return;
    }
#else
    (void)packed;
    (void)v;
#endif
#if COLIBRI_ROW_PAIRS
    if (G <= 4 && Dh % 8 == 0) {
      if (G == 1) return key_pair_scores<2, 1>(k, n, Dh, qs, s, ns, next);
      if (G == 2) return key_pair_scores<6, 2>(k, n, Dh, qs, s, ns, next);
      if (G == 3) return key_pair_scores<4, 3>(k, n, Dh, qs, s, ns, next);
      return key_pair_scores<3, 4>(k, n, Dh, qs, s, ns, next);
    }
#endif
    auto emit = [&](int64_t t, int64_t j, float d) {
      s[j * ns + t] = d;
      if (j == 0 && t < next.n) fetch(next.rows, t, t + 1, Dh);
    };
    matvecs(k, n, Dh, qs, G, emit, Dh);
  }

#if defined(__AVX512F__) && defined(__AVX512DQ__)
  static constexpr int64_t kKeyBlock = 48;  // keys a block of key_blocks (96 KiB at Dh 512)

  // Scores of the heads packed in x (more than eight of them, or MLA's) against n keys: block
  // by block of kKeyBlock keys, each two groups of heads over the block's keys in tiles of
  // three keys against both (24 sums), a last odd group in tiles of three keys against it:
  // the block's keys, in L2, meet every group, and two groups' heads, in L1, every key of the
  // block. Every group over every key of a tile in turn instead read all the heads from L2 at
  // every tile (64 KiB at MLA's 32 heads of 512 columns, 43 bytes a cycle: the score tiles at
  // half the cores' multiply-adds; docs/kernels.md, "MLA's attention at the cores' ceiling").
  // The first two groups fetch the next block's keys into L2 as they go (a line of each key a
  // cache line of its columns), and the next item's keys and a long item's values v (where
  // given) a key a key, as `scores` does. The sums of pairs.h's tiles.
  template <typename Emit>
  static void key_blocks(const KeyRows& keys, const float* v, int64_t n, const Packed& x,
                         Emit& emit, const Ahead& next) {
    const int64_t Dh = keys.ld;
    const int64_t vrows = v && n * Dh * 4 > kAhead ? (512 << 10) / (Dh * 4) : 0;
    for (int64_t t0 = 0; t0 < n; t0 += kKeyBlock) {
      const int64_t t1 = std::min(n, t0 + kKeyBlock), whole = t0 + (t1 - t0) / 3 * 3;
      for (int64_t g = 0; g < x.groups(); g += 2) {
        const bool first = g == 0;
        const int64_t pairs = x.pairs(g) + (g + 1 < x.groups() ? x.pairs(g + 1) : 0);
        for (int64_t t = t0; t < whole; t += 3) {
          if (first && t < next.n) fetch(next.rows, t, std::min(t + 3, next.n), Dh);
          if (first && t < vrows) fetch(v, t, std::min({t + 3, n, vrows}), Dh);
          switch (pairs) {
#define COLIBRI_KEYS(p)                                              \
  case p:                                                            \
    key_tile<3, p>(keys, t, x, g, emit, first ? kKeyBlock : 0);      \
    break;
            COLIBRI_KEYS(1) COLIBRI_KEYS(2) COLIBRI_KEYS(3) COLIBRI_KEYS(4) COLIBRI_KEYS(5)
            COLIBRI_KEYS(6) COLIBRI_KEYS(7) COLIBRI_KEYS(8)
#undef COLIBRI_KEYS
          }
        }
      }
      for (int64_t t = whole; t < t1; ++t) {  // a last key or two, against every group
        if (t < next.n) fetch(next.rows, t, t + 1, Dh);
        if (t < vrows) fetch(v, t, t + 1, Dh);
        for (int64_t g = 0; g < x.groups(); ++g) switch (x.pairs(g)) {
#define COLIBRI_KEY(p)                          \
  case p:                                       \
    key_tile<1, p>(keys, t, x, g, emit, 0);     \
    break;
            COLIBRI_KEY(1) COLIBRI_KEY(2) COLIBRI_KEY(3) COLIBRI_KEY(4)
#undef COLIBRI_KEY
          }
      }
    }
  }

  // Keys t .. t + TW against TP pairs of heads: group g's, and group g + 1's past four (where
  // TP > 4), the columns of k and then of k2 (MLA), each key's lines `ahead` keys on fetched
  // into L2 as the tile reaches them (none where 0).
  template <int TW, int TP, typename Emit>
  static void key_tile(const KeyRows& keys, int64_t t, const Packed& x, int64_t g, Emit& emit,
                       int64_t ahead) {
    constexpr int64_t sa = std::min(TP, 4) * 16, sb = std::max(TP - 4, 0) * 16;
    const float *w[TW], *w2[TW];
    int64_t rows[TW];
    for (int i = 0; i < TW; ++i) {
      rows[i] = t + i;
      w[i] = keys.k + (t + i) * keys.ld;
      w2[i] = keys.k2 + (t + i) * keys.ld2;
    }
    v16 acc[TW][TP];
    for (int i = 0; i < TW; ++i)
      for (int p = 0; p < TP; ++p) acc[i][p] = v16{};
    const float *a = x.group(g), *b = x.group(g + 1);
    const auto pass = [&](const float* const* rows, int64_t L, int64_t ld) {
      for (int64_t c = 0; c < L; c += 8) {
        if (c % 16 == 0)  // (into L1 two lines ahead too: 0.97-0.98x the time)
          for (int i = 0; i < TW; ++i) {
            __builtin_prefetch(rows[i] + c + 128, 0, 3);
            if (ahead) __builtin_prefetch(rows[i] + ahead * ld + c, 0, 2);
          }
        pair_step<TP>(rows, a + (c / 8) * sa, b + (c / 8) * sb, c, acc,
                      std::make_index_sequence<TW>{});
      }
    };
    const int64_t L8 = keys.ld / 8 * 8;  // (with k2, L8 is ld: MlaAttend)
    pass(w, L8, keys.ld);
    a += L8 / 8 * sa;
    b += L8 / 8 * sb;
    if (keys.k2) pass(w2, keys.ld2, keys.ld2);
    float out[TW * 2 * TP];
    pair_sums<TW, TP>(acc, w, x, g * Packed::kGroup, x.inputs(g) + (TP > 4 ? x.inputs(g + 1) : 0),
                      out);
    emit_group<TW>(rows, x, emit, g, out, 2 * TP);
    if constexpr (TP > 4) emit_group<TW>(rows, x, emit, g + 1, out + Packed::kGroup, 2 * TP);
  }
#endif

#if COLIBRI_ROW_PAIRS
  // `scores` for one to four heads a KV head (AVX-512 builds), keys in pairs: one key in the
  // low half of a 512-bit vector, another in the high, each head's eight columns in both, so
  // that one multiply-add advances two keys' 8-lane sums, each half exactly the sum tiles.h's
  // `dots` makes (and pair_hsums each half's horizontal sum, as `hsums`): the same bits, in
  // half the multiply-adds of the 8-lane tiles. TP pairs a tile, its 2 TP keys a stream_gap
  // apart (2 TP streams, as tiles.h reads rows: 2 TP neighbouring keys side by side took
  // 1.10x the time at one row, 1.04x at four; docs/kernels.md, "Keys a stream apart": one
  // head's two pairs, four streams, as tiles.h's one-input tiles read theirs); the
  // keys past them in neighbouring pairs, a last odd key through `dots`; the next item's keys
  // (or a long item's own, lead_rows ahead) fetched as the tiles go.
  template <int TP, int G>
  static void key_pair_scores(const float* k, int64_t n, int64_t Dh, const float* const* qs,
                              float* s, int64_t ns, const Ahead& next) {
    const int64_t lead = n * Dh * 4 > kAhead ? lead_rows(Dh) : n;  // (short: fetched already)
    // Rows [t, t + m): the next item's, and this one's lead_rows on, fetched now.
    const auto fetches = [&](int64_t t, int64_t m) {
      if (t < next.n) fetch(next.rows, t, std::min(t + m, next.n), Dh);
      if (t + lead < n) fetch(k, t + lead, std::min(t + lead + m, n), Dh);
    };
    const int64_t gap = stream_gap(n, 2 * TP);
    int64_t idx[2 * TP];
    for (int64_t r = 0; r < gap; ++r) {
      for (int i = 0; i < 2 * TP; ++i) idx[i] = r + i * gap;
      // The rows to fetch as the tile goes, those of its keys' own positions: the next item's
      // (short items), else this one's lead_rows on (a long one), spread over its steps (a
      // tile's rows' lines at once left it waiting: 1.14x the time at 16 rows, 1.18x at 1024
      // positions).
      const int64_t last = idx[2 * TP - 1];
      const float* ahead = last < next.n ? next.rows : last + lead < n ? k + lead * Dh : nullptr;
      if (!ahead)
        for (int i = 0; i < 2 * TP; ++i) fetches(idx[i], 1);
      key_pairs<TP, G>(k, idx, Dh, qs, s, ns, ahead);
    }
    int64_t t = 2 * TP * gap;
    for (; t + 2 <= n; t += 2) {
      fetches(t, 2);
      const int64_t two[2] = {t, t + 1};
      key_pairs<1, G>(k, two, Dh, qs, s, ns, nullptr);
    }
    if (t < n) {
      fetches(t, 1);
      const float* w[1] = {k + t * Dh};
      float out[G];
      dots<1, G>(w, qs, Dh, out);
      for (int j = 0; j < G; ++j) s[j * ns + t] = out[j];
    }
  }

  // s[j * ns + idx[i]] = q[j] . k[idx[i]] for the tile's 2 TP keys (pair p: keys idx[2p] and
  // idx[2p + 1]) and the G heads; rows idx[i] of `ahead` (of Dh floats), if given, fetched
  // into L2 meanwhile.
  template <int TP, int G>
  __attribute__((always_inline)) static void key_pairs(const float* k, const int64_t* idx,
                                                       int64_t Dh, const float* const* qs,
                                                       float* s, int64_t ns, const float* ahead) {
    v16 acc[TP][G];
    for (int p = 0; p < TP; ++p)
      for (int j = 0; j < G; ++j) acc[p][j] = v16{};
    for (int64_t c = 0; c < Dh; c += 8) {
      v16 qv[G];
      for (int j = 0; j < G; ++j) {
        qv[j] = reinterpret_cast<v16>(_mm512_broadcast_f32x8(_mm256_loadu_ps(qs[j] + c)));
        in_register(qv[j]);
      }
      for (int p = 0; p < TP; ++p) {
        const float* a = k + idx[2 * p] * Dh + c;
        const float* b = k + idx[2 * p + 1] * Dh + c;
        const v16 kv = reinterpret_cast<v16>(_mm512_insertf32x8(
            _mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1));
        for (int j = 0; j < G; ++j) acc[p][j] = fma16(kv, qv[j], acc[p][j]);
        // 2 TP rows of `ahead` a share each step: the lines of rows 2p and 2p + 1 at c.
        if (ahead && c % 16 == 0) {
          __builtin_prefetch(ahead + idx[2 * p] * Dh + c, 0, 2);
          __builtin_prefetch(ahead + idx[2 * p + 1] * Dh + c, 0, 2);
        }
      }
    }
    float out[2 * TP * G];  // out[2 (p G + j) + h]: key t + 2p + h against head j
    pair_hsums<TP * G>(&acc[0][0], out);
    for (int p = 0; p < TP; ++p)
      for (int j = 0; j < G; ++j)
        for (int h = 0; h < 2; ++h) s[j * ns + idx[2 * p + h]] = out[2 * (p * G + j) + h];
  }
#endif

#if defined(__AVX512F__)
  using Vec = v16;  // the values' vectors: 512 bits where the build has them
  static constexpr int kHeads = 4;  // query heads a tile of values keeps sums for
#else
  using Vec = v8;
  static constexpr int kHeads = 2;
#endif
  static constexpr int kLanes = sizeof(Vec) / sizeof(float);
  static constexpr int kVecs = 4;  // vectors of columns a tile keeps per head
  // Positions a block of values: about 16 KiB of them, in L1 while every tile passes over it.
  static int64_t block_rows(int64_t Dh) { return std::max<int64_t>(8, 4096 / Dh); }

  // o[j, d] += sum over from <= t < n of p[j, t] * v[t, d] for the G heads (p: rows of np
  // floats) and the Dh columns of v (rows of Dh floats), every sum one multiply-add chain in
  // order of t from o's values: block by block of positions (block_rows), tiles of kHeads
  // heads by kVecs vectors of columns (the columns a tile loads serve its kHeads heads), the
  // sums waiting in o between blocks; the columns past the last whole tile eight at a time,
  // then one by one. Many heads' sums over whole tiles of columns go strip by strip instead
  // (values_by_strips).
  // Each block fetches the next block's values as it starts, and its first tile positions
  // [0, ahead_n) of `ahead` (the next item's values), a position a position.
  static void values(const float* p, int64_t np, const float* v, int64_t from, int64_t n,
                     int64_t Dh, int64_t G, float* o, const float* ahead, int64_t ahead_n) {
    const int64_t wide = Dh / (kLanes * kVecs) * (kLanes * kVecs), eights = Dh / 8 * 8;
    if (G >= kHeads && Dh == wide && G * Dh * 4 >= kStripFrom) {
      values_by_strips(p, np, v, from, n, Dh, G, o);
      if (0 < ahead_n) fetch(ahead, 0, ahead_n, Dh);
      return;
    }
    const bool one_tile = G <= kHeads && Dh == wide && wide == kLanes * kVecs;
    const int64_t rows = one_tile ? n : block_rows(Dh);  // (one tile reads the values once)
    for (int64_t t0 = from; t0 < n; t0 += rows) {
      const int64_t t1 = std::min(n, t0 + rows);
      // The first tile of the block fetches the next item's values, a position a position, or
      // where there are none, this item's next block.
      Ahead next{ahead, std::min(t1, ahead_n), Dh};
      if (t1 < n && ahead_n == 0)
        next = {v + (t1 - t0) * Dh, std::min(t1, n - (t1 - t0)), Dh};
      else if (t1 < n)
        fetch(v, t1, std::min(n, t1 + rows), Dh);
      for (int64_t d = 0; d < wide; d += kLanes * kVecs) {
        int64_t j = 0;
        for (; j + kHeads <= G; j += kHeads, next.n = 0)
          tile<Vec, kHeads, kVecs>(p + j * np, np, v + d, Dh, t0, t1, o + j * Dh + d, Dh, next);
        if (j < G)
          last_heads(G - j, p + j * np, np, v + d, Dh, t0, t1, o + j * Dh + d, Dh, next);
        next.n = 0;
      }
      for (int64_t d = wide; d < eights; d += 8)
        for (int64_t j = 0; j < G; ++j, next.n = 0)
          tile<v8, 1, 1>(p + j * np, np, v + d, Dh, t0, t1, o + j * Dh + d, Dh, next);
      if (next.n > t0) fetch(ahead, t0, next.n, Dh);  // (no tile above: Dh < 8)
      for (int64_t d = eights; d < Dh; ++d)
        for (int64_t j = 0; j < G; ++j) {
          float acc = o[j * Dh + d];
          for (int64_t t = t0; t < t1; ++t) acc = std::fma(p[j * np + t], v[t * Dh + d], acc);
          o[j * Dh + d] = acc;
        }
    }
    if (n < ahead_n) fetch(ahead, n, ahead_n, Dh);
  }

  // The heads' sums a call of `values` may keep (G Dh floats) below which they go through its
  // blocks of positions whole, and from which strip by strip (values_by_strips).
  static constexpr int64_t kStripFrom = 32 << 10;
  static constexpr int64_t kStrip = kLanes * kVecs;  // columns a strip: a tile's
  static constexpr int64_t kStripRows = 64;          // positions a block of a strip

  // `values` where G heads' sums over Dh columns would not stay in L1 while the blocks pass
  // (MLA's query heads over 512 latent columns: 64 KiB at 32 heads, loaded from L2 and stored
  // back at every block of eight positions, the tiles at under half the cores' multiply-adds;
  // docs/kernels.md, "MLA's attention at the cores' ceiling"): strip by strip of kStrip columns,
  // every head's sums of the strip in `sums` (G kStrip floats, in L1 between blocks), block
  // by block of kStripRows positions, each block's tiles fetching the next block's rows of the
  // strip (or the next strip's first block), a share of its rows a tile. The same
  // multiply-adds in the same order as block by block of positions.
  static void values_by_strips(const float* p, int64_t np, const float* v, int64_t from,
                               int64_t n, int64_t Dh, int64_t G, float* o) {
    thread_local std::vector<float> buf;
    float* sums = aligned_floats(buf, G * kStrip);
    const int64_t tiles = (G + kHeads - 1) / kHeads;
    const int64_t share = (kStripRows + tiles - 1) / tiles;  // rows a tile fetches
    for (int64_t d = 0; d < Dh; d += kStrip) {
      for (int64_t j = 0; j < G; ++j)
        std::memcpy(sums + j * kStrip, o + j * Dh + d, sizeof(float) * kStrip);
      for (int64_t t0 = from; t0 < n; t0 += kStripRows) {
        const int64_t t1 = std::min(n, t0 + kStripRows);
        // The block after this one: the strip's next rows, else the next strip's first.
        const bool last = t1 == n;
        const float* next = v + (last ? d + kStrip : d);
        const int64_t f0 = last ? from : t1, f1 = std::min(n, f0 + kStripRows);
        for (int64_t j = 0, q = 0; j < G; j += kHeads, ++q) {
          if (!last || d + kStrip < Dh)
            for (int64_t t = f0 + q * share; t < std::min(f1, f0 + (q + 1) * share); ++t)
              for (int64_t c = 0; c < kStrip; c += 16) __builtin_prefetch(next + t * Dh + c, 0, 2);
          const Ahead none{nullptr, 0, Dh};
          if (j + kHeads <= G)
            tile<Vec, kHeads, kVecs>(p + j * np, np, v + d, Dh, t0, t1, sums + j * kStrip,
                                     kStrip, none);
          else
            last_heads(G - j, p + j * np, np, v + d, Dh, t0, t1, sums + j * kStrip, kStrip,
                       none);
        }
      }
      for (int64_t j = 0; j < G; ++j)
        std::memcpy(o + j * Dh + d, sums + j * kStrip, sizeof(float) * kStrip);
    }
  }

  // `tile` for the last heads of a group, fewer than kHeads, in one tile (sums ldo apart).
  static void last_heads(int64_t heads, const float* p, int64_t np, const float* v, int64_t Dh,
                         int64_t t0, int64_t t1, float* o, int64_t ldo, const Ahead& next) {
    switch (heads) {
      case 1:
        return tile<Vec, 1, kVecs>(p, np, v, Dh, t0, t1, o, ldo, next);
      case 2:
        return tile<Vec, 2, kVecs>(p, np, v, Dh, t0, t1, o, ldo, next);
      default:
        static_assert(kHeads <= 4, "last_heads tiles up to three heads");
        return tile<Vec, 3, kVecs>(p, np, v, Dh, t0, t1, o, ldo, next);
    }
  }

  // The sums o[h * ldo + NV vectors] of HB heads advanced over positions [t0, t1): each
  // position's NV vectors of values loaded once for the HB heads. Not inlined: inside drain()
  // GCC kept such sums in memory. The loops over heads and vectors unrolled by pragma: GCC 12
  // at -O3 otherwise kept 8-lane sums (AVX2 builds) in a stack array, stored there at every
  // position (the values' tiles at a third of the multiply-add ceiling).
  template <typename V, int HB, int NV>
  __attribute__((noinline)) static void tile(const float* p, int64_t np, const float* v,
                                             int64_t ld, int64_t t0, int64_t t1, float* o,
                                             int64_t ldo, const Ahead& next) {
    constexpr int W = sizeof(V) / sizeof(float);
    V acc[HB][NV];
#pragma GCC unroll 8
    for (int h = 0; h < HB; ++h)
      for (int i = 0; i < NV; ++i) acc[h][i] = vector(V{}, o + h * ldo + W * i);
    for (int64_t t = t0; t < t1; ++t) {
      if (t < next.n) fetch(next.rows, t, t + 1, next.Dh);
      V x[NV];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        x[i] = vector(V{}, v + t * ld + W * i);
        in_register(x[i]);
      }
#pragma GCC unroll 8
      for (int h = 0; h < HB; ++h) {
        const V w = splat(V{}, p + h * np + t);
        for (int i = 0; i < NV; ++i) acc[h][i] = fma_lanes(w, x[i], acc[h][i]);
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < HB; ++h)
      for (int i = 0; i < NV; ++i) store(o + h * ldo + W * i, acc[h][i]);
  }

  // s[0 .. n) <- softmax(scale * s) in place; s has room for n rounded up to 16 floats:
  // online_softmax's from nothing kept, then times 1 / l.
  static void softmax(float* s, int64_t n, float scale) {
    float M = -INFINITY, l = 0.0f;
    online_softmax(s, n, scale, M, l);
    const v8 inv = v8{} + (l > 0 ? 1.0f / l : 0.0f);
    for (int64_t t = 0; t < n; t += 8) {
      const v8 e = load8(s + t) * inv;
      std::memcpy(s + t, &e, sizeof e);
    }
  }
};

// A call over caches k and v (rows of Dh floats, C positions a slot and cache head) for q
// [B, H, Dh] into out, its rows grouped (what both targets' calls start from); cache_heads as
// AttendCall takes it (MLA's 1).
std::shared_ptr<AttendCall> attend_call(const float* q, const float* k, const float* v,
                                        ffi::Buffer<ffi::S32>& slots,
                                        ffi::Buffer<ffi::S32>& pos, float* out, int64_t B,
                                        int64_t H, int64_t Hkv, int64_t Dh, int64_t S,
                                        int64_t C, float scale, int64_t cache_heads = 0) {
  auto call = std::make_shared<AttendCall>();
  call->cache_heads = cache_heads;
  call->q = q;
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
  call->group();
  return call;
}

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
  auto call = attend_call(q.typed_data(), k, v, slots, pos, out, B, H, Hkv, Dh, S, C, scale);
  // Fewer items than two a thread (one row of two KV heads): one at a time, else the first
  // thread claimed them all (10.5 GB/s instead of 21 at 4096 positions, one row of gqa128).
  call->claim_ahead = call->items() >= 2 * std::max<int64_t>(pool.num_threads(), 1);
  int64_t bytes = 0;  // keys and values read
  for (int64_t b = 0; b < B; ++b) bytes += call->positions(b) * Hkv * Dh * 8;
  // Work: the keys and values once for each query head that reads them, as the linear
  // kernel counts a pass over its weights for every four inputs (a call whose bytes alone are
  // under kSoloWork, one row of a grouped-query model, costs several times their streaming).
  run(pool, call, call->items(), bytes * (H / Hkv), CallKind::kAttention, B);
  return ffi::Error::Success();
}

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slots,
                  ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out, float scale) {
  return attend_into(pool, q, k.typed_data(), v.typed_data(), k.dimensions(), v.dimensions(),
                     slots, pos, out->typed_data(), out->dimensions(), scale);
}

// colibri_mla_attend: multi-head latent attention of one new token per row over the latent
// cache (attention.mla_attend_latent): out[b, h] = softmax_t(scale (q[b, h] . lat[s, t] +
// qr[b, h] . kr[s, t])) . lat[s, t] over t = 0 .. pos[b] of slot s = slots[b] that keep[b, t]
// (where keep [B, L] has columns: t < L), for q and out [B, H, r], qr [B, H, R], lat [S, C, r]
// and kr [S, C, R], r and R multiples of 8. colibri_attend's items with every query head
// reading the one latent cache (its keys and its values), each score one dot product over a
// latent and its roped key (latent_scores); a row's heads in groups of sixteen or more where
// there are fewer rows than threads, so that one row's attention is shared out too, each
// thread claiming an item at a time (two claimed at once would leave a thread of a one-row
// call idle).
ffi::Error MlaAttend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> qr,
                     ffi::Buffer<ffi::F32> lat, ffi::Buffer<ffi::F32> kr,
                     ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> pos,
                     ffi::Buffer<ffi::U8> keep, ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), rd = qr.dimensions(), ld = lat.dimensions(),
             kd = kr.dimensions(), md = keep.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || rd.size() != 3 || ld.size() != 3 || kd.size() != 3 || md.size() != 2 ||
      od.size() != 3 || slots.dimensions().size() != 1 || pos.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("colibri_mla_attend: wrong ranks");
  const int64_t B = qd[0], H = qd[1], r = qd[2], R = rd[2], S = ld[0], C = ld[1];
  if (rd[0] != B || rd[1] != H || ld[2] != r || kd[0] != S || kd[1] != C || kd[2] != R ||
      md[0] != B || !(od == qd) || slots.dimensions()[0] != B || pos.dimensions()[0] != B ||
      H == 0)
    return ffi::Error::InvalidArgument("colibri_mla_attend: shapes disagree");
  if (r % 8 || R % 8)
    return ffi::Error::InvalidArgument(
        "colibri_mla_attend: the latents' and roped keys' widths must be multiples of 8");
  int64_t groups = 1;  // of a row's heads, each an item
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  while (B * groups < threads && H % (2 * groups) == 0 && H / (2 * groups) >= 16) groups *= 2;
  const float* latents = lat.typed_data();
  auto call = attend_call(q.typed_data(), latents, latents, slots, pos, out->typed_data(), B, H,
                          groups, r, S, C, scale, 1);
  call->claim_ahead = false;
  call->qr = qr.typed_data();
  call->kr = kr.typed_data();
  call->R = R;
  call->keep = md[1] ? keep.typed_data() : nullptr;
  call->keep_len = md[1];
  int64_t bytes = 0;  // latents and roped keys read
  for (int64_t b = 0; b < B; ++b) bytes += call->positions(b) * (r + R) * 4;
  run(pool, call, call->items(), bytes * H, CallKind::kLatentAttention, B);
  return ffi::Error::Success();
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
