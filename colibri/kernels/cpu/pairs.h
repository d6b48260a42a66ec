// Tiles of 512-bit vectors that keep the 8-lane order of the sums (AVX-512 builds): a vector
// holds two inputs' eight columns side by side, so one multiply-add advances two dot products'
// 8-lane accumulators at once, each exactly as tiles.h's `dots` advances it. The inputs are
// packed for that once per call (`Packed`); a weight vector is loaded into both halves.
//
// A tile keeps three weight rows against up to eight inputs (12 sums, 3 weight vectors, 1 input
// vector), the inputs coming as one sequential stream instead of one per input. More inputs
// than eight come in groups of eight, each group over the whole slice of rows before the next
// (float32 and bfloat16 rows): a group's inputs (8 L floats, 24 KiB at L = 768) stay in L1
// while the rows stream past, and the next group reads the slice from L2. Sixteen inputs a
// tile (48 KiB at L = 768, an L1's size) computed from DRAM at about half their rate from
// cache (docs/kernels.md, "Groups of eight inputs"). Rows of more than 512 columns take two
// groups a pass instead, block by block of columns (TwoGroups), and stream once for both.
// Results are bitwise those of tiles.h (cpu.cc, "Exactness"; tests/test_kernels.py compares
// this build with the AVX2 one, which has no such tiles).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "formats.h"
#include "simd.h"
#include "tiles.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512DQ__)
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

// Linear calls with this many inputs or more go through the paired tiles (where the build has
// them), and experts this many rows chose; fewer stream their weights through tiles.h's
// (docs/kernels.md).
constexpr int64_t kPairedFrom = 5;

// r inputs of L floats packed for the paired tiles, in groups of 8: group g holds inputs
// 8 g .. 8 g + 7 as ceil(L / 8) chunks of eight columns, each chunk its inputs' eight
// columns pair by pair ([input 2p | input 2p + 1] in 16 floats), so that a tile's step reads
// one 16-float vector a pair, one after another. A last chunk of fewer than eight columns and
// the second half of a last pair without an input are zeros.
struct Packed {
  static constexpr int64_t kGroup = 8;
  static constexpr int64_t kFull = kGroup / 2;  // pairs in a full group
  float* data = nullptr;
  int64_t r = 0, L = 0;
  int64_t nch = 0;     // chunks of eight columns: ceil(L / 8)
  int64_t last = 0;    // the last group
  int64_t tail = 0;    // pairs in the last group (every other group has 8)

  Packed() = default;
  Packed(float* data, int64_t r, int64_t L)
      : data(data), r(r), L(L), nch((L + 7) / 8), last(r > 0 ? (r - 1) / kGroup : 0),
        tail(r > 0 ? (r - last * kGroup + 1) / 2 : 0) {}

  int64_t groups() const { return r > 0 ? last + 1 : 0; }
  int64_t inputs(int64_t g) const { return std::min(kGroup, r - g * kGroup); }
  int64_t pairs(int64_t g) const { return g == last ? tail : kFull; }
  // Floats r inputs of L take (every group but the last is full).
  static int64_t floats(int64_t r, int64_t L) {
    if (r <= 0) return 0;
    const int64_t chunks = (L + 7) / 8, full = (r - 1) / kGroup, last = r - full * kGroup;
    return (full * kFull + (last + 1) / 2) * 16 * chunks;
  }
  float* group(int64_t g) const { return data + g * kFull * 16 * nch; }
  // Where column c of input j is.
  float* at(int64_t j, int64_t c) const {
    const int64_t g = j / kGroup, k = j % kGroup;
    return group(g) + (c / 8) * pairs(g) * 16 + (k / 2) * 16 + (k % 2) * 8 + c % 8;
  }
  // Zeros where no input's column is: the tail chunk's lanes from L on, a missing last input.
  void clear_padding() const {
    if (L % 8)
      for (int64_t j = 0; j < r; ++j) std::memset(at(j, L), 0, sizeof(float) * (8 - L % 8));
    if (r % 2)
      for (int64_t c = 0; c < nch; ++c) std::memset(at(r - 1, 8 * c) + 8, 0, sizeof(float) * 8);
  }
  // Copy x[0 .. r) in.
  void pack(const float* const* x) const {
    const int64_t L8 = L / 8 * 8;
    for (int64_t j = 0; j < r; ++j) {
      for (int64_t c = 0; c < L8; c += 8) std::memcpy(at(j, c), x[j] + c, sizeof(float) * 8);
      if (L8 < L) std::memcpy(at(j, L8), x[j] + L8, sizeof(float) * (L - L8));
    }
    clear_padding();
  }
};

// Where paired tiles put their results for a destination packed as inputs are (the expert
// call's hidden rows): row f of the weights (offset by f0) is column f0 + f of every input.
// Within a group, input k's column c lies 8 k floats past input 0's, so a row's results go
// out as one strided store instead of one `Packed::at` each.
struct PackedOut {
  const Packed* to;
  int64_t f0;
};

// Whether float32 and bfloat16 rows of L columns met by `groups` groups of inputs take them two
// groups a pass (TwoGroups): rows longer than 512 columns, where sixteen inputs (64 L bytes) would
// crowd L1. At 512 columns two groups a pass took 1.03-1.10x the time of a group at a time; at 768
// 0.92-0.95x, at 2048 0.66-0.78x (AMD; docs/kernels.md, "Two groups a pass"). Builds for Intel
// cores take rows of 384 and 512 columns two groups a pass too, in one block (kernels.tuning passes
// COLIBRI_TWO_GROUPS_FROM=384): there a core's tiles compute from DRAM at 0.6 of their rate from
// L2, and a group at a time left the arithmetic idle while the first group's pass waited on memory
// (16-row expert calls on the olmoe shape 0.92-0.96x the time, on qwen3_moe's 384-column down
// projections 0.965x; docs/kernels.md, "An Intel Xeon with AMX", "Rows of 384 columns two groups a
// pass").
// Builds for Zen 4 take rows from 384 columns two groups a pass where those two groups are all
// the inputs, 9 to 16 (kernels.tuning passes COLIBRI_TWO_GROUPS_ALONE_FROM=384): the rows then
// stream from memory once instead of once for each group, the first group's pass waiting on
// memory (expert calls at 9 to 16 rows 0.89-0.955x the time on the olmoe shape, 0.98-0.99x on
// qwen3_moe's); more groups find the rows in L2 after the first pass, and a 128-token prefill's
// expert calls with every pair of groups so taken took 1.03x (docs/kernels.md, "Two groups a
// pass on Zen 4").
#ifndef COLIBRI_TWO_GROUPS_FROM
#define COLIBRI_TWO_GROUPS_FROM 513
#endif
#ifndef COLIBRI_TWO_GROUPS_ALONE_FROM
#define COLIBRI_TWO_GROUPS_ALONE_FROM COLIBRI_TWO_GROUPS_FROM
#endif
constexpr bool two_groups_a_pass(int64_t L, int64_t groups) {
  return L >= COLIBRI_TWO_GROUPS_FROM || (groups <= 2 && L >= COLIBRI_TWO_GROUPS_ALONE_FROM);
}

// Rows of up to this many columns meet their two groups of inputs a tile of rows a third of
// the matrix apart at a time, each row whole (TwoGroups::walk); longer ones block by block of
// columns. Builds for Intel cores and Zen 4 take rows of 768 columns whole too (kernels.tuning
// passes COLIBRI_ONE_BLOCK_TO=768): their 16 inputs fill the 48 KiB L1 (overflow Zen 4's 32),
// yet 16-row linear calls over such rows from DRAM took 0.91-0.92x the time (Zen 4: 0.88-0.91x,
// expert calls 0.93x); at 1024 columns 1.00x, at 2048 1.04x (docs/kernels.md, "Rows of 768
// columns whole", "Rows of 768 columns whole on Zen 4").
#ifndef COLIBRI_ONE_BLOCK_TO
#define COLIBRI_ONE_BLOCK_TO 512
#endif

// Whether a call's items may be gang.h's kLongItems times their usual size where `inputs`
// inputs meet rows of L columns held as T: where the rows stream from memory once, a tile at a
// time, at most four inputs (one tile) or, in the paired tiles, float32 and bfloat16 rows met by
// one group of eight inputs or by two a pass. Other groups of eight pass over the whole item
// each, the next finding it in L2. Scaled rows met by more than four inputs, widened into L1
// a tile at a time, took 1.02-1.08x the time in long items (int8, Zen 5; docs/kernels.md,
// "Longer items at one pass").
template <typename T>
constexpr bool long_items(const T*, int64_t inputs, int64_t L) {
  if (inputs <= 4) return true;
  if constexpr (kPairs && !kScaled<T> && !kProducts<T>)
    return inputs <= Packed::kGroup || (inputs <= 2 * Packed::kGroup && two_groups_a_pass(L, 2));
  return false;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)

// Eight weights from p, widened as loadw widens them, in both halves.
inline v16 loadw2(const float* p) {
  return reinterpret_cast<v16>(_mm512_broadcast_f32x8(_mm256_loadu_ps(p)));
}

inline v16 loadw2(const uint16_t* p) {
  const __m128i eight = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i twice = _mm256_broadcastsi128_si256(eight);
  return reinterpret_cast<v16>(_mm512_slli_epi32(_mm512_cvtepu16_epi32(twice), 16));
}

// acc[i][p] += wv_i * (pair p's columns) for the tile's weight vectors, passed as values and
// pinned in registers as in tiles.h. The columns of pairs 0 .. 3 are read from a, those of
// pairs 4 on (a second group's, TwoGroups) from b.
template <int TP, typename... V>
__attribute__((always_inline)) inline void multiply_add_pairs(v16 (*acc)[TP], const float* a,
                                                              const float* b, V... wv) {
  (in_register(wv), ...);
  for (int p = 0; p < TP; ++p) {
    v16 xv = load16(p < Packed::kFull ? a + 16 * p : b + 16 * (p - Packed::kFull));
    in_register(xv);
    int i = 0;
    ((acc[i][p] = fma16(wv, xv, acc[i][p]), ++i), ...);
  }
}

template <int TP, typename T, size_t... I>
__attribute__((always_inline)) inline void pair_step(const T* const* w, const float* a,
                                                     const float* b, int64_t c, v16 (*acc)[TP],
                                                     std::index_sequence<I...>) {
  multiply_add_pairs<TP>(acc, a, b, loadw2(w[I] + c)...);
}

// out[i * 2 TP + j] = the sums acc[i][p] of a tile's TW rows and TP pairs made into dot
// products: each half's horizontal sum, then the scalar tail past the last whole eight
// columns, for the n inputs from input j0 of x on (their pairs in order).
template <int TW, int TP, typename T>
__attribute__((always_inline)) inline void pair_sums(const v16 (*acc)[TP], const T* const* w,
                                                     const Packed& x, int64_t j0, int64_t n,
                                                     float* out) {
  const int64_t L = x.L, L8 = L / 8 * 8;
  pair_hsums<TW * TP>(&acc[0][0], out);
  if (L8 < L)
    for (int i = 0; i < TW; ++i)
      for (int64_t j = 0; j < n; ++j) {
        float s = out[i * 2 * TP + j];
        const float* xj = x.at(j0 + j, L8);
        for (int64_t t = L8; t < L; ++t) s = std::fma(widen(w[i][t]), xj[t - L8], s);
        out[i * 2 * TP + j] = s;
      }
}

// out[i * 2 TP + j] = dot(w[i], input j) over L columns for the TW weight rows and the inputs
// of one group of x (TP pairs): the 8-lane sums of tiles.h's `dots`, two a vector, then the
// same horizontal sums and scalar tail. Fetch (attention's score tiles, attend.h): TW rows
// of L floats from f0 and from f1, where given, fetched into L2 as the weights are, a line of
// each row a cache line of weights (fetched all at once before the tile, their lines left it
// waiting: docs/kernels.md, "Keys in pairs").
template <int TW, int TP, bool Fetch = false, typename T>
inline void pair_dots(const T* const* w, const Packed& x, int64_t g, float* out,
                      const float* f0 = nullptr, const float* f1 = nullptr) {
  const int64_t L = x.L, L8 = L / 8 * 8;
  const float* xg = x.group(g);
  v16 acc[TW][TP];
  for (int i = 0; i < TW; ++i)
    for (int p = 0; p < TP; ++p) acc[i][p] = v16{};
  for (int64_t c = 0; c < L8; c += 8) {
    if (c % (64 / sizeof(T)) == 0) {  // once a cache line, into L2 4 KiB ahead (as tiles.h)
      for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + c + 4096 / sizeof(T), 0, 2);
      if constexpr (Fetch) {
        for (int i = 0; i < TW && f0; ++i) __builtin_prefetch(f0 + i * L + c, 0, 2);
        for (int i = 0; i < TW && f1; ++i) __builtin_prefetch(f1 + i * L + c, 0, 2);
      }
    }
    const float* xc = xg + (c / 8) * TP * 16;
    pair_step<TP>(w, xc, xc, c, acc, std::make_index_sequence<TW>{});
  }
  pair_sums<TW, TP>(acc, w, x, g * Packed::kGroup, x.inputs(g), out);
}

// The results of a tile's TW rows against the inputs of group g, out[i * stride + j] for
// input j of the group, emitted (or stored into the packed destination).
template <int TW, typename Emit>
__attribute__((always_inline)) inline void emit_group(const int64_t* rows, const Packed& x,
                                                      Emit& emit, int64_t g, const float* out,
                                                      int64_t stride) {
  const int64_t n = x.inputs(g);
  if constexpr (std::is_same_v<Emit, PackedOut>) {
    const Packed& to = *emit.to;
    const int64_t pairs = to.pairs(g);
    for (int i = 0; i < TW; ++i) {
      const int64_t c = emit.f0 + rows[i];
      float* at = to.group(g) + (c / 8) * pairs * 16 + c % 8;
      for (int64_t j = 0; j < n; ++j) at[8 * j] = out[i * stride + j];
    }
  } else {
    const int64_t j0 = g * Packed::kGroup;
    for (int i = 0; i < TW; ++i)
      for (int64_t j = 0; j < n; ++j) emit(rows[i], j0 + j, out[i * stride + j]);
  }
}

// Rows w[0 .. TW) (their indices `rows`) against every input of x: emit(row, j, value).
// Fetch: f0 and f1 as pair_dots takes them, in group g0's pass.
template <int TW, bool Fetch = false, typename T, typename Emit>
inline void pair_tiles(const T* const* w, const int64_t* rows, const Packed& x, Emit& emit,
                       int64_t g0, int64_t g1, const float* f0 = nullptr,
                       const float* f1 = nullptr) {
  float out[TW * Packed::kGroup];
  for (int64_t g = g0; g < g1; ++g, f0 = f1 = nullptr) {
    switch (x.pairs(g)) {
#define COLIBRI_PAIRS(n)                             \
  case n:                                            \
    pair_dots<TW, n, Fetch>(w, x, g, out, f0, f1); \
    break;
      COLIBRI_PAIRS(1) COLIBRI_PAIRS(2) COLIBRI_PAIRS(3) COLIBRI_PAIRS(4)
#undef COLIBRI_PAIRS
    }
    emit_group<TW>(rows, x, emit, g, out, 2 * x.pairs(g));
  }
}

// Two groups at once (float32 and bfloat16 rows): a full group g and the next, of TP1 pairs, in
// tiles of TW rows against all 8 + 2 TP1 inputs (TW (4 + TP1) sums), column block by column
// block. A block's inputs (kBlock columns of both groups, 16 KiB) stay in L1 while every tile of
// a run of kRun tiles passes over that block's columns of its rows, the tiles' sums (24 KiB)
// waiting in memory between blocks: each lane's sum still runs in order of column from zero,
// so the results are bitwise pair_dots's. The rows stream once for both groups instead of
// once from memory and again from L2.
template <int TW, int TP1>
struct TwoGroups {
  static constexpr int TP = Packed::kFull + TP1;  // pairs a tile meets
  static constexpr int64_t kBlock = 256;          // columns a block
  static constexpr int64_t kRun = 16;             // tiles whose sums wait at once

  // acc[i][p] advanced over columns c0 .. c1 of the tile's rows, each row's cache line fetched
  // into L2 `ahead` elements on as the tile reaches it.
  template <typename T>
  __attribute__((always_inline)) static void steps(const T* const* w, const float* a,
                                                   const float* b, int64_t c0, int64_t c1,
                                                   v16 (*acc)[TP], int64_t ahead) {
    for (int64_t c = c0; c < c1; c += 8) {
      if (c % (64 / sizeof(T)) == 0)
        for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + ahead + c, 0, 2);
      pair_step<TP>(w, a + (c / 8) * Packed::kFull * 16, b + (c / 8) * TP1 * 16, c, acc,
                    std::make_index_sequence<TW>{});
    }
  }

  // The same for a block of columns, the tile's sums coming from and going back to `sums`.
  template <typename T>
  __attribute__((always_inline)) static void block(const T* const* w, const float* a,
                                                   const float* b, int64_t c0, int64_t c1,
                                                   v16* sums, int64_t ahead) {
    v16 acc[TW][TP];
    for (int i = 0; i < TW; ++i)
      for (int p = 0; p < TP; ++p) acc[i][p] = sums[i * TP + p];
    steps(w, a, b, c0, c1, acc, ahead);
    for (int i = 0; i < TW; ++i)
      for (int p = 0; p < TP; ++p) sums[i * TP + p] = acc[i][p];
  }

  // Rows 0 .. TW gap (the caller takes the rest one at a time). Rows of several blocks go in
  // tiles of TW adjacent rows, each tile prefetching, into L2, the same columns of the rows two
  // tiles on (past the matrix for the last two tiles: prefetches never fault): adjacent rows so
  // prefetched streamed faster there than rows a third apart (1.00x against 0.93x the time at 768
  // columns, AMD). Rows of one block (up to COLIBRI_ONE_BLOCK_TO columns: 512, whose sixteen
  // inputs, 32 KiB, stay in L1; 768 on Intel cores and Zen 4) go in tiles of rows a third apart
  // instead, each row's stream fetched two rows ahead: three long runs of rows, not a run of
  // three short ones, kept two cores computing 16 inputs at 0.81-0.86 of their read against
  // 0.75-0.79 (Intel; docs/kernels.md, "Rows a third apart in one block"); their sums stay in
  // registers from the first column to the last, not in memory between tiles (a core's tiles from
  // L2 1.1-1.3x the rate; "A tile's sums in registers").
  template <typename T, typename Emit>
  static void walk(const T* W, int64_t gap, int64_t L, int64_t ld, const Packed& x, int64_t g,
                   Emit& emit) {
    const int64_t L8 = L / 8 * 8;
    const float *a = x.group(g), *b = x.group(g + 1);
    const T* w[TW];
    int64_t rows[TW];
    float out[TW * 2 * TP];
    // The results of the tile of rows `rows` (w) from its sums, emitted for both groups.
    const auto results = [&](const v16(*acc)[TP]) {
      pair_sums<TW, TP>(acc, w, x, g * Packed::kGroup, Packed::kGroup + x.inputs(g + 1), out);
      emit_group<TW>(rows, x, emit, g, out, 2 * TP);
      emit_group<TW>(rows, x, emit, g + 1, out + Packed::kGroup, 2 * TP);
    };
    if (L8 <= COLIBRI_ONE_BLOCK_TO) {
      for (int64_t t = 0; t < gap; ++t) {
        for (int i = 0; i < TW; ++i) {
          rows[i] = t + i * gap;
          w[i] = W + rows[i] * ld;
        }
        v16 acc[TW][TP];
        for (int i = 0; i < TW; ++i)
          for (int p = 0; p < TP; ++p) acc[i][p] = v16{};
        steps(w, a, b, 0, L8, acc, 2 * ld);
        results(acc);
      }
      return;
    }
    thread_local std::vector<v16> sums;
    sums.resize(kRun * TW * TP);
    for (int64_t t0 = 0; t0 < gap; t0 += kRun) {
      const int64_t nt = std::min(kRun, gap - t0);
      std::fill(sums.begin(), sums.begin() + nt * TW * TP, v16{});
      for (int64_t c0 = 0; c0 < L8; c0 += kBlock)
        for (int64_t t = 0; t < nt; ++t) {
          for (int i = 0; i < TW; ++i) w[i] = W + (TW * (t0 + t) + i) * ld;
          block(w, a, b, c0, std::min(L8, c0 + kBlock), sums.data() + t * TW * TP, 2 * TW * ld);
        }
      for (int64_t t = 0; t < nt; ++t) {
        for (int i = 0; i < TW; ++i) {
          rows[i] = TW * (t0 + t) + i;
          w[i] = W + rows[i] * ld;
        }
        results(reinterpret_cast<const v16(*)[TP]>(sums.data() + t * TW * TP));
      }
    }
  }
};

// matvecs over packed inputs, TW weight rows a tile, the rows of a tile about R / TW apart
// (stream_gap): the row walk of tiles.h's `matvecs` (scaled rows widened into L1), over paired
// tiles; long float32 and bfloat16 rows two groups a pass (TwoGroups). (Sharing that walk
// through a callback measured 2-4% slower on 16-row int8 expert calls.)
template <int TW, typename T, typename Emit>
inline void pair_matvecs(const T* W, int64_t R, int64_t L, const Packed& x, Emit& emit,
                         int64_t ld, int64_t blk) {
  const int64_t gap = stream_gap(R, TW);
  if constexpr (kScaled<T>) {
    // Scaled rows widened once, TW at a time, into float32 rows in L1 (as tiles.h does), the
    // next TW rows fetched into L2 meanwhile (widen_tile).
    thread_local std::vector<float> buf;
    float* const wide = aligned_floats(buf, TW * L);
    const float* w[TW];
    int64_t rows[TW];
    for (int i = 0; i < TW; ++i) w[i] = wide + i * L;
    for (int64_t row = 0; row < gap; ++row) {
      for (int i = 0; i < TW; ++i) rows[i] = row + i * gap;
      widen_tile<TW>(W, rows, ld, L, blk, wide, row + 1 < gap);
      pair_tiles<TW>(w, rows, x, emit, 0, x.groups());
    }
    int64_t row = gap * TW;
    for (; row + TW <= R; row += TW) {  // the rest in tiles of TW adjacent rows while they last
      for (int i = 0; i < TW; ++i) rows[i] = row + i;
      widen_tile<TW>(W, rows, ld, L, blk, wide, false);
      pair_tiles<TW>(w, rows, x, emit, 0, x.groups());
    }
    for (; row < R; ++row) {
      widen_row(W + row * ld, L, blk, wide);
      pair_tiles<1>(w, &row, x, emit, 0, x.groups());
    }
  } else {
    (void)blk;
    const T* w[TW];
    int64_t rows[TW];
    for (int64_t g = 0; g < x.groups();) {  // two groups over every row, then the next
      int64_t n = 1;
      if constexpr (TW == 3) {
        if (g + 1 < x.groups() && two_groups_a_pass(L, x.groups())) {
          switch (x.pairs(g + 1)) {
#define COLIBRI_TWO(p)                                               \
  case p:                                                            \
    TwoGroups<TW, p>::walk(W, gap, L, ld, x, g, emit);                \
    break;
            COLIBRI_TWO(1) COLIBRI_TWO(2) COLIBRI_TWO(3) COLIBRI_TWO(4)
#undef COLIBRI_TWO
          }
          n = 2;
        }
      }
      if (n == 1)
        for (int64_t row = 0; row < gap; ++row) {
          for (int i = 0; i < TW; ++i) {
            rows[i] = row + i * gap;
            w[i] = W + rows[i] * ld;
          }
          pair_tiles<TW>(w, rows, x, emit, g, g + 1);
        }
      // The rows past the tiles' (up to 2 TW - 1 of them: stream_gap keeps the tiles' streams
      // an odd number of rows apart) in tiles of TW adjacent rows while they last, then of two,
      // then one by one: a row alone meets its inputs at half the tiles' rate or less.
      int64_t row = gap * TW;
      const auto adjacent = [&](auto k) {  // a tile of the next k rows
        constexpr int K = decltype(k)::value;
        for (int i = 0; i < K; ++i) {
          rows[i] = row + i;
          w[i] = W + rows[i] * ld;
        }
        pair_tiles<K>(w, rows, x, emit, g, g + n);
        row += K;
      };
      while (row + TW <= R) adjacent(std::integral_constant<int, TW>{});
      if (row + 2 <= R) adjacent(std::integral_constant<int, 2>{});
      while (row < R) adjacent(std::integral_constant<int, 1>{});
      g += n;
    }
  }
}

#endif

// Apply the rows w[0..R) of a [R, L] matrix (rows `ld` elements apart) to the inputs packed in
// x (x.L == L): emit(row, j, value) for every row and input, bitwise as tiles.h's `matvecs`
// over the same inputs as rows. Three weight rows a tile (up to 12 sums), four where the first
// group has only one or two pairs. Only where kPairs.
template <typename T, typename Emit>
void matvecs(const T* W, int64_t R, int64_t L, const Packed& x, Emit emit, int64_t ld = 0,
             int64_t blk = 0) {
  if (ld == 0) ld = L;
  if (x.r <= 0) return;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if (x.pairs(0) > 2)
    pair_matvecs<3>(W, R, L, x, emit, ld, blk);
  else
    pair_matvecs<4>(W, R, L, x, emit, ld, blk);
#else
  (void)W, (void)R, (void)emit, (void)blk;
  __builtin_trap();  // inputs are packed only where kPairs
#endif
}

}  // namespace
