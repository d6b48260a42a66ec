// The dot-product tiles: a few weight rows against a few input rows at a time, every weight
// widened as its format says (formats.h) while it is in registers, and `matvecs`, which applies
// a matrix's rows to a set of inputs in such tiles. Each dot product is computed the same way
// whatever tile it falls in (cpu.cc, "Exactness").

#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "formats.h"
#include "simd.h"

// How far ahead, in bytes, the tiles of one input prefetch their rows into L2 (0: not at all,
// the headers' default): 4 KiB ahead took one-row calls from DRAM 0.85-0.96x the time on an
// Intel Xeon, 1.04-1.13x on AMD Zen 4, where 1 KiB ahead took 0.95-0.97x (docs/kernels.md,
// "One input's rows fetched ahead", "One input's rows 1 KiB ahead on Zen 4"); kernels.tuning
// passes 4096 for Intel cores, 1024 for Zen 4.
// Held rows (int4, int8, FP8) met by one to four inputs go through the row pairs of AVX-512
// builds (row_pair_dots), or, at 0, through the 8-lane tiles (`dots`): on Zen 4, whose 512-bit
// operations each take a pair of its 256-bit pipes, the 8-lane tiles made the weights faster
// (kernels.tuning(); docs/kernels.md, "Held rows in 8 lanes on Zen 4").
#ifndef COLIBRI_HELD_PAIRS
#define COLIBRI_HELD_PAIRS 1
#endif
#ifndef COLIBRI_ONE_INPUT_FETCH
#define COLIBRI_ONE_INPUT_FETCH 0
#endif

namespace {

// acc[i][j] += wv_i * x[j][c .. c + 8) for the TW weight vectors of a tile, passed as
// values: held in an array, GCC kept them in memory and stored every one to the stack at each
// step (three stores per twelve multiply-adds).
template <int TR, typename... V>
__attribute__((always_inline)) inline void multiply_add(v8 (*acc)[TR], const float* const* x,
                                                        int64_t c, V... wv) {
  (in_register(wv), ...);
  for (int j = 0; j < TR; ++j) {
    v8 xv = load8(x[j] + c);
    in_register(xv);
    int i = 0;
    ((acc[i][j] = fma8(wv, xv, acc[i][j]), ++i), ...);
  }
}

// One step of `dots`: columns [c, c + 8) of every weight row against every input.
template <int TR, typename T, size_t... I>
__attribute__((always_inline)) inline void step(const T* const* w, const float* const* x,
                                                int64_t c, v8 (*acc)[TR],
                                                std::index_sequence<I...>) {
  multiply_add<TR>(acc, x, c, loadw(w[I] + c)...);
}

// out[i * TR + j] = dot(w[i], x[j]) over L floats, for TW weight rows and TR input rows.
// `blk`: FP8 rows' block width (unused for float and bfloat16 weights).
template <int TW, int TR, typename T>
inline void dots(const T* const* w, const float* const* x, int64_t L, float* out,
                 int64_t blk = 0) {
  (void)blk;
  v8 acc[TW][TR];
  for (int i = 0; i < TW; ++i)
    for (int j = 0; j < TR; ++j) acc[i][j] = v8{};
  int64_t c = 0;
  for (; c + 8 <= L; c += 8) {
    // Keep the next weights coming, 4 KiB ahead in each row's stream, into L2 (into L1 and
    // 2 KiB ahead, tiles of several inputs took up to 1.4x the time). One input's rows too
    // where the build says how far ahead (COLIBRI_ONE_INPUT_FETCH), but not short ones
    // (attention's keys, which it fetches itself: 1.035x the time so). docs/kernels.md, "One
    // input's rows fetched ahead".
    constexpr int64_t ahead = TR > 1 ? 4096 : COLIBRI_ONE_INPUT_FETCH;
    if (ahead && (TR > 1 || L > 256))
      if (c % (64 / sizeof(T)) == 0)  // once a cache line
        for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + c + ahead / sizeof(T), 0, 2);
    step(w, x, c, acc, std::make_index_sequence<TW>{});
  }
  hsums<TW * TR>(&acc[0][0], out);
  if (c < L)
    for (int i = 0; i < TW; ++i)
      for (int j = 0; j < TR; ++j) {
        float s = out[i * TR + j];
        for (int64_t t = c; t < L; ++t) s = std::fma(widen(w[i][t]), x[j][t], s);
        out[i * TR + j] = s;
      }
}

// Columns [c0, c0 + blk) of TW int4 rows held lane-major (blk a multiple of 32), a group (or
// half of one) at a time, its steps unrolled so that their shifts are known (formats.h's
// lane_pieces): step(c) for each, the rows fetched `ahead` bytes ahead into L1 once a cache
// line.
template <int TW, typename Q, typename Step>
__attribute__((always_inline)) inline void lane_steps(const Q* const* w, int64_t c0,
                                                      int64_t blk, int64_t ahead, Step step) {
  lane_pieces(c0, blk, [&](int64_t g, auto first, auto steps) __attribute__((always_inline)) {
    constexpr int s0 = decltype(first)::value, s1 = s0 + decltype(steps)::value;
    if (g % 128 == 0 && s0 == 0)
      for (int i = 0; i < TW; ++i)
        __builtin_prefetch(reinterpret_cast<const char*>(w[i]) + g / 2 + ahead, 0, 3);
#pragma GCC unroll 8
    for (int s = s0; s < s1; ++s) step(g + 8 * s);
  });
}

// One step of `scaled_block`: the same over rows widened and scaled as they are loaded.
template <bool Huge, bool Lanes, int TR, typename Q, size_t... I>
__attribute__((always_inline)) inline void scaled_step(const Q* const* w, const float* const* x,
                                                       int64_t c, const v8* scale,
                                                       const v8* offset, v8 (*acc)[TR],
                                                       std::index_sequence<I...>) {
  multiply_add<TR>(acc, x, c, scaled8<Huge, Lanes>(w[I], c, scale[I], offset[I])...);
}

// Columns [c0, c0 + blk) of `dots` over scaled rows (FP8 or int4): each weight widened and
// times scale[i], its row's block scale as scaled8 takes it (Huge: FP8 scales from 2^8 up;
// Lanes: int4 values lane-major).
template <int TW, int TR, bool Huge, bool Lanes, typename Q>
inline void scaled_block(const Q* const* w, const float* const* x, int64_t c0, int64_t blk,
                         const v8* scale, const v8* offset, v8 (*acc)[TR]) {
  if constexpr (Lanes) {  // 2 KiB ahead, as below
    lane_steps<TW>(w, c0, blk, 2048, [&](int64_t c) __attribute__((always_inline)) {
      scaled_step<Huge, true>(w, x, c, scale, offset, acc, std::make_index_sequence<TW>{});
    });
    return;
  }
  for (int64_t c = c0; c < c0 + blk; c += 8) {
    {
      // Once a cache line of values, into L1 2 KiB ahead (into L2 as `dots` does: up to 1.17x
      // the time), and here for a single input too: one-row calls over FP8 and int8 rows are
      // much slower without it (float32 and bfloat16 rows, which stream fast alone, are
      // slower with it).
      const int64_t at = value_bytes(w[0], c);
      if (at % 64 == 0)
        for (int i = 0; i < TW; ++i)
          __builtin_prefetch(reinterpret_cast<const char*>(w[i]) + at + 2048, 0, 3);
    }
    scaled_step<Huge, false>(w, x, c, scale, offset, acc, std::make_index_sequence<TW>{});
  }
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
// One step of `looked_up_block`: the eight weights of each row from column c, looked up in its
// block's table (lo, hi: its halves; formats.h's looked_up8), then multiplied in.
template <bool Lanes, int TR, typename Q, size_t... I>
__attribute__((always_inline)) inline void looked_up_step(const Q* const* w,
                                                          const float* const* x, int64_t c,
                                                          const __m256* lo, const __m256* hi,
                                                          v8 (*acc)[TR],
                                                          std::index_sequence<I...>) {
  multiply_add<TR>(acc, x, c, looked_up8<Lanes>(w[I], c, lo[I], hi[I])...);
}

// Columns [c0, c0 + blk) of `scaled_dots` over int4 rows, their weights looked up rather than
// made: the block's sixteen weights of each row made once (block_table), each step's by a
// shift and a permute of 256 bits. The same weights and multiply-adds in the same order: the
// same bits.
template <int TW, int TR, bool Lanes, typename Q>
inline void looked_up_block(const Q* const* w, const float* const* x, int64_t c0, int64_t blk,
                            int64_t vb, int64_t nb, v8 (*acc)[TR]) {
  __m256 lo[TW], hi[TW];
  for (int i = 0; i < TW; ++i) {
    const __m512 table = block_table(w[i], vb, nb, c0 / blk);
    lo[i] = _mm512_castps512_ps256(table);
    hi[i] = upper_half(table);
  }
  if constexpr (Lanes) {  // 1 KiB ahead, as below
    lane_steps<TW>(w, c0, blk, 1024, [&](int64_t c) __attribute__((always_inline)) {
      looked_up_step<true, TR>(w, x, c, lo, hi, acc, std::make_index_sequence<TW>{});
    });
    return;
  }
  for (int64_t c = c0; c < c0 + blk; c += 8) {
    const int64_t at = c / 2;
    if (at % 64 == 0)  // once a cache line, 1 KiB ahead into L1
      for (int i = 0; i < TW; ++i)
        __builtin_prefetch(reinterpret_cast<const char*>(w[i]) + at + 1024, 0, 3);
    looked_up_step<false, TR>(w, x, c, lo, hi, acc, std::make_index_sequence<TW>{});
  }
}
#endif

// The same over scaled rows: w[i] is a row's L values (value_bytes of them), its L / blk
// float32 block scales right after them (L a multiple of blk, blk of 8; Int4Z: then as many
// offsets). Each weight is widened and scaled as it is loaded, then the same multiply-adds in
// the same order: bitwise the dot of the dequantized float32 row.
template <int TW, int TR, typename Q>
inline void scaled_dots(const Q* const* w, const float* const* x, int64_t L, float* out,
                        int64_t blk) {
  v8 acc[TW][TR];
  for (int i = 0; i < TW; ++i)
    for (int j = 0; j < TR; ++j) acc[i][j] = v8{};
  const int64_t vb = value_bytes(w[0], L), nb = L / blk;
  for (int64_t c0 = 0; c0 < L; c0 += blk) {
#if defined(__AVX512F__) && defined(__AVX512VL__)
    if constexpr (kNibbles<Q>) {  // int4 weights looked up (AVX-512's 256-bit permutes)
      if (lane_major(blk, L))
        looked_up_block<TW, TR, true>(w, x, c0, blk, vb, nb, acc);
      else
        looked_up_block<TW, TR, false>(w, x, c0, blk, vb, nb, acc);
      continue;
    }
#endif
    v8 scale[TW], offset[TW];
    bool huge = false;
    for (int i = 0; i < TW; ++i) {
      float s;
      std::memcpy(&s, reinterpret_cast<const char*>(w[i]) + vb + 4 * (c0 / blk), sizeof s);
      huge = huge || too_big(w[i], s);
      scale[i] = v8{} + s;
      if constexpr (kOffsets<Q>) offset[i] = v8{} + block_offset(w[i], vb, nb, c0 / blk);
    }
    // Only Int4Z rows keep offsets: the others pass their scales in their place, unused.
    const v8* off = kOffsets<Q> ? offset : scale;
    if (huge) {
      scaled_block<TW, TR, true, false>(w, x, c0, blk, scale, off, acc);
    } else {
      for (int i = 0; i < TW; ++i) scale[i] = scale[i] * folded(w[i]);
      if constexpr (kNibbles<Q>) {
        if (lane_major(blk, L)) {
          scaled_block<TW, TR, false, true>(w, x, c0, blk, scale, off, acc);
          continue;
        }
      }
      scaled_block<TW, TR, false, false>(w, x, c0, blk, scale, off, acc);
    }
  }
  hsums<TW * TR>(&acc[0][0], out);
}

template <int TW, int TR>
inline void dots(const uint8_t* const* w, const float* const* x, int64_t L, float* out,
                 int64_t blk) {
  scaled_dots<TW, TR>(w, x, L, out, blk);
}

template <int TW, int TR>
inline void dots(const Int4* const* w, const float* const* x, int64_t L, float* out,
                 int64_t blk) {
  scaled_dots<TW, TR>(w, x, L, out, blk);
}

template <int TW, int TR>
inline void dots(const Int4Z* const* w, const float* const* x, int64_t L, float* out,
                 int64_t blk) {
  scaled_dots<TW, TR>(w, x, L, out, blk);
}

template <int TW, int TR>
inline void dots(const Int8Z* const* w, const float* const* x, int64_t L, float* out,
                 int64_t blk) {
  scaled_dots<TW, TR>(w, x, L, out, blk);
}

// The row pairs below need AVX-512 with its 256-bit forms (VL) and DQ (the halves' extraction).
#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define COLIBRI_ROW_PAIRS 1
#else
#define COLIBRI_ROW_PAIRS 0
#endif

#if COLIBRI_ROW_PAIRS
// Rows held so go through `row_pair_dots` at up to four inputs (AVX-512 builds): int4, int8
// and FP8 rows, whose weights take several operations each to make.
template <typename T>
constexpr bool kRowPairs =
    kNibbles<T> || std::is_same_v<T, Int8Z> || std::is_same_v<T, uint8_t>;

// Sixteen int8 or FP8 weights from their bytes placed in 32-bit lanes: int8 zero-extended,
// converted, then n s + o (ta: each half's row's scale, tb: its offset); FP8 with the sign in
// bit 31 and exponent and mantissa in bits 26..20 (bits 30..27 anything: masked off, as
// e4m3x8 places them), times each half's scale (ta; Huge: times 2^120 first, as scaled8).
template <bool Huge, typename Q>
__attribute__((always_inline)) inline v16 byte_weights(__m512i lanes, __m512 ta, __m512 tb) {
  if constexpr (std::is_same_v<Q, Int8Z>) {
    return fma16(reinterpret_cast<v16>(_mm512_cvtepi32_ps(lanes)), reinterpret_cast<v16>(ta),
                 reinterpret_cast<v16>(tb));
  } else {
    (void)tb;
    const v16 e = reinterpret_cast<v16>(_mm512_castsi512_ps(
        _mm512_and_si512(lanes, _mm512_set1_epi32(static_cast<int32_t>(0x87f00000u)))));
    return (Huge ? e * 0x1p120f : e) * reinterpret_cast<v16>(ta);
  }
}

// Sixteen weights of rows a and b (a's in the low half) from the value byte `at` of each, made
// as scaled8 makes them. Int4 (in order; lane-major rows take nibble_pair_line): looked up in
// the rows' block tables (ta, tb: formats.h) by one shift, one mask (the second row's table
// bit) and one two-table permute. Int8: sixteen bytes
// zero-extended; FP8: sign-extended and shifted by 20; then byte_weights.
template <bool Huge, typename Q>
__attribute__((always_inline)) inline v16 row_pair_weights(const uint8_t* a, const uint8_t* b,
                                                           __m512 ta, __m512 tb) {
  if constexpr (kNibbles<Q>) {
    const __m512i shift =
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i second = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16,
                                             16, 16);
    uint32_t wa, wb;
    std::memcpy(&wa, a, sizeof wa);
    std::memcpy(&wb, b, sizeof wb);
    const __m512i words = _mm512_mask_set1_epi32(_mm512_set1_epi32(wa), 0xff00, wb);
    const __m512i index = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(words, shift),
                                                    _mm512_set1_epi32(15), second,
                                                    0xea);  // A & B | C
    return reinterpret_cast<v16>(_mm512_permutex2var_ps(ta, index, tb));
  } else {
    int64_t ba, bb;
    std::memcpy(&ba, a, sizeof ba);
    std::memcpy(&bb, b, sizeof bb);
    const __m128i bytes = _mm_mask_set1_epi64(_mm_set1_epi64x(ba), 0x2, bb);
    if constexpr (std::is_same_v<Q, Int8Z>)
      return byte_weights<Huge, Q>(_mm512_cvtepu8_epi32(bytes), ta, tb);
    else
      return byte_weights<Huge, Q>(_mm512_slli_epi32(_mm512_cvtepi8_epi32(bytes), 20), ta, tb);
  }
}

// Columns [c0, c0 + blk) of `row_pair_dots` over int4 rows held lane-major (blk a multiple of
// 32), eight steps at a time (or four, where a block is half a group): a group's 32 bytes of
// each row of a pair in one 512-bit vector, a row's in each half. One mask (A & 15 in every
// byte, the second row's table bit set) makes the indices of steps 0-3 in the four bytes of
// every lane, one shift and one mask those of steps 4-7, and a shift by 8, 16 or 24 brings a
// step's byte down to its lane's index, where the permute reads its five low bits only: ten
// operations for eight steps of a pair, which in order take four (a broadcast, a multishift,
// a mask and a shift) for every two steps. The same lookups, the same multiply-adds in the
// same order as row_pair_weights'.
// (Inlined where it is called: out of line, its sums and tables went through memory, and
// one-row expert calls over int4 rows took 1.3x the time.)
template <int TP, int TR>
__attribute__((always_inline)) inline void nibble_pair_line(const void* const* w,
                                                            const float* const* x, int64_t c0,
                                                            int64_t blk, const __m512* table,
                                                            v16 (*acc)[TR]) {
  constexpr int TW = 2 * TP;
  const __m512i second = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x10101010, 0x10101010,
                                           0x10101010, 0x10101010, 0x10101010, 0x10101010,
                                           0x10101010, 0x10101010);
  const __m512i low = _mm512_set1_epi32(0x0f0f0f0f);
  lane_pieces(c0, blk, [&](int64_t g, auto first, auto steps) __attribute__((always_inline)) {
    constexpr int s0 = decltype(first)::value, s1 = s0 + decltype(steps)::value;
    const int64_t at = g / 2;
    if (at % 64 == 0 && s0 == 0)  // as row_pair_block: once a cache line, 1024 columns ahead
      for (int i = 0; i < TW; ++i)
        __builtin_prefetch(static_cast<const char*>(w[i]) + at + 512, 0, 3);
    for (int p = 0; p < TP; ++p) {
      const auto group = [&](int i) {
        return _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const char*>(w[i]) + at));
      };
      const __m512i both =
          _mm512_inserti64x4(_mm512_castsi256_si512(group(2 * p)), group(2 * p + 1), 1);
      // Steps 0-3's indices (A & B | C), and 4-7's from the bytes shifted by 4: those the
      // piece takes.
      const __m512i early = s0 < 4 ? _mm512_ternarylogic_epi32(both, low, second, 0xea) : both;
      const __m512i late =
          s1 > 4 ? _mm512_ternarylogic_epi32(_mm512_srli_epi32(both, 4), low, second, 0xea)
                 : both;
      // Every step's indices before the first permute, which may then overwrite its own.
      __m512i index[8];
#pragma GCC unroll 8
      for (int s = s1 - 1; s >= s0; --s) {
        const __m512i from = s < 4 ? early : late;
        index[s] = s % 4 == 0 ? from : _mm512_srli_epi32(from, 8 * (s % 4));
      }
#pragma GCC unroll 8
      for (int s = s0; s < s1; ++s) {
        const v16 wv = reinterpret_cast<v16>(
            _mm512_permutex2var_ps(table[2 * p], index[s], table[2 * p + 1]));
        for (int j = 0; j < TR; ++j)
          acc[p][j] = fma16(wv,
                            reinterpret_cast<v16>(
                                _mm512_broadcast_f32x8(_mm256_loadu_ps(x[j] + g + 8 * s))),
                            acc[p][j]);
      }
    }
  });
}

#if defined(__AVX512VBMI__)
// Columns [c0, c0 + blk) of `row_pair_dots` over int4 rows in order (blk a multiple of 16),
// two steps at a time: eight bytes of each row of a pair (the nibbles of columns c .. c + 16) in one
// 512-bit vector, a row's in each half, and both steps' indices picked from them by one
// multishift (each lane's bytes 0 and 1 from its nibbles' bits on), where row_pair_weights
// broadcasts four bytes of each row a step and shifts them. The same lookups, the same
// multiply-adds in the same order: bitwise row_pair_weights' sums.
template <int TP, int TR>
__attribute__((always_inline)) inline void nibble_pair_block(const void* const* w,
                                                             const float* const* x, int64_t c0,
                                                             int64_t blk, const __m512* table,
                                                             v16 (*acc)[TR]) {
  constexpr int TW = 2 * TP;
  // Byte 0 of dword lane l of each half <- bits 4 (l % 8) on of its quadword (step c's
  // nibble l); byte 1 <- bits 4 (l % 8) + 32 on (step c + 8's). One multishift and one
  // ternary-logic operation make both steps' indices, the second step's shifted down by a
  // byte: one operation fewer for every 32 weights than a multishift and a mask a step.
  const __m512i both_steps = _mm512_set_epi64(
      0x00003c1c00003818, 0x0000341400003010, 0x00002c0c00002808, 0x0000240400002000,
      0x00003c1c00003818, 0x0000341400003010, 0x00002c0c00002808, 0x0000240400002000);
  const __m512i second = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x1010, 0x1010, 0x1010,
                                           0x1010, 0x1010, 0x1010, 0x1010, 0x1010);
  const __m512i low = _mm512_set1_epi32(0x0f0f);
  for (int64_t c = c0; c < c0 + blk; c += 16) {
    const int64_t at = c / 2;
    if (at % 64 == 0)  // as row_pair_block: once a cache line, 1024 columns ahead into L1
      for (int i = 0; i < TW; ++i)
        __builtin_prefetch(static_cast<const char*>(w[i]) + at + 512, 0, 3);
    v16 x0[TR], x1[TR];
    for (int j = 0; j < TR; ++j) {
      x0[j] = reinterpret_cast<v16>(_mm512_broadcast_f32x8(_mm256_loadu_ps(x[j] + c)));
      x1[j] = reinterpret_cast<v16>(_mm512_broadcast_f32x8(_mm256_loadu_ps(x[j] + c + 8)));
    }
    for (int p = 0; p < TP; ++p) {
      int64_t qa, qb;
      std::memcpy(&qa, static_cast<const char*>(w[2 * p]) + at, sizeof qa);
      std::memcpy(&qb, static_cast<const char*>(w[2 * p + 1]) + at, sizeof qb);
      const __m512i both = _mm512_mask_set1_epi64(_mm512_set1_epi64(qa), 0xf0, qb);
      const __m512i i0 = _mm512_ternarylogic_epi32(
          _mm512_multishift_epi64_epi8(both_steps, both), low, second, 0xea);  // A & B | C
      const __m512i i1 = _mm512_srli_epi32(i0, 8);
      const v16 w0 = reinterpret_cast<v16>(_mm512_permutex2var_ps(table[2 * p], i0,
                                                                  table[2 * p + 1]));
      const v16 w1 = reinterpret_cast<v16>(_mm512_permutex2var_ps(table[2 * p], i1,
                                                                  table[2 * p + 1]));
      for (int j = 0; j < TR; ++j) acc[p][j] = fma16(w0, x0[j], acc[p][j]);
      for (int j = 0; j < TR; ++j) acc[p][j] = fma16(w1, x1[j], acc[p][j]);
    }
  }
}

// Columns [l, l + 64) of `row_pair_dots` over int8 or FP8 rows (a cache line of values a
// row): each pair's 32 columns at a time in one 512-bit vector (row a's bytes in the low half,
// b's in the high), each step's sixteen bytes put into their lanes by one byte permute, where
// row_pair_weights inserts the second row's eight bytes and then extends them. Int8: each
// byte into the low byte of its lane, zero above (zero-extended). FP8: into the high byte,
// then shifted arithmetically by 4: the sign in bits 31..27, exponent and mantissa in 26..20,
// as the sign extension and shift by 20 place them. The same lanes, then byte_weights as
// row_pair_weights: the same bits. One shuffle fewer for every sixteen weights, on
// the one port that takes them: int8 calls at one row 0.89x the time, FP8 0.93-0.95x
// (docs/kernels.md, "Bytes by permutes").
template <bool Huge, int TP, int TR, typename Q>
__attribute__((always_inline)) inline void byte_pair_line(const uint8_t* const* w,
                                                          const float* const* x, int64_t l,
                                                          const __m512* table, v16 (*acc)[TR]) {
  constexpr bool kInt8 = std::is_same_v<Q, Int8Z>;
  constexpr int kAt = kInt8 ? 0 : 3;  // the byte of its lane a value goes to
  const __mmask64 at = kInt8 ? 0x1111111111111111ull : 0x8888888888888888ull;
  __m512i pick[4];  // step s: bytes 8 s .. 8 s + 7 of each half into lanes 0-7 and 8-15
  for (int s = 0; s < 4; ++s) {
    alignas(64) uint8_t idx[64] = {};
    for (int lane = 0; lane < 16; ++lane)
      idx[4 * lane + kAt] = static_cast<uint8_t>((lane < 8 ? 0 : 32) + 8 * s + lane % 8);
    pick[s] = _mm512_load_si512(idx);
  }
  for (int h = 0; h < 64; h += 32) {
    __m512i both[TP];
    for (int p = 0; p < TP; ++p)
      both[p] = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[2 * p] + l + h))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[2 * p + 1] + l + h)), 1);
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      const int64_t c = l + h + 8 * s;
      v16 xv[TR];
      for (int j = 0; j < TR; ++j) {
        xv[j] = reinterpret_cast<v16>(_mm512_broadcast_f32x8(_mm256_loadu_ps(x[j] + c)));
        in_register(xv[j]);
      }
      for (int p = 0; p < TP; ++p) {
        const __m512i q = _mm512_maskz_permutexvar_epi8(at, pick[s], both[p]);
        const v16 wv = byte_weights<Huge, Q>(kInt8 ? q : _mm512_srai_epi32(q, 4), table[2 * p],
                                             table[2 * p + 1]);
        for (int j = 0; j < TR; ++j) acc[p][j] = fma16(wv, xv[j], acc[p][j]);
      }
    }
  }
}
#endif

// Columns [c0, c0 + blk) of `row_pair_dots` (rows of L columns): table[2 p], table[2 p + 1]
// as row_pair_weights takes them for pair p.
template <bool Huge, int TP, int TR, typename Q>
inline void row_pair_block(const Q* const* w, const float* const* x, int64_t c0, int64_t blk,
                           int64_t L, const __m512* table, v16 (*acc)[TR]) {
  constexpr int TW = 2 * TP;
  if constexpr (kNibbles<Q>) {
    if (lane_major(blk, L))
      return nibble_pair_line<TP, TR>(reinterpret_cast<const void* const*>(w), x, c0, blk,
                                      table, acc);
  }
#if defined(__AVX512VBMI__)
  // (At three and four inputs the two steps' inputs and sums leave too few registers: those
  // tiles took 1.04x the time in olmoe's four-row expert calls.)
  if constexpr (kNibbles<Q> && TR <= 2) {
    if (blk % 16 == 0)  // int4 rows with VBMI: two steps at a time
      return nibble_pair_block<TP, TR>(reinterpret_cast<const void* const*>(w), x, c0, blk,
                                       table, acc);
  }
#endif
  const auto step = [&](int64_t c) __attribute__((always_inline)) {
    const int64_t at = value_bytes(w[0], c);
    v16 xv[TR];
    for (int j = 0; j < TR; ++j) {
      xv[j] = reinterpret_cast<v16>(_mm512_broadcast_f32x8(_mm256_loadu_ps(x[j] + c)));
      in_register(xv[j]);
    }
    for (int p = 0; p < TP; ++p) {
      const v16 wv = row_pair_weights<Huge, Q>(reinterpret_cast<const uint8_t*>(w[2 * p]) + at,
                                               reinterpret_cast<const uint8_t*>(w[2 * p + 1]) + at,
                                               table[2 * p], table[2 * p + 1]);
      for (int j = 0; j < TR; ++j) acc[p][j] = fma16(wv, xv[j], acc[p][j]);
    }
  };
  // A cache line of values at a time, its steps unrolled: a step of eight columns each with a
  // test for the prefetch and the rows' pointers advanced one by one kept scalar operations on
  // the vector ports (int8 rows at one input: a core's tiles from L2 about 1.1x as fast without
  // them; docs/kernels.md, "Block tables from memory").
  constexpr int64_t kLine = kNibbles<Q> ? 128 : 64;  // columns a cache line of values holds
  for (int64_t l = c0; l < c0 + blk; l += kLine) {
    // Once a cache line of values, into L1 1024 columns ahead (int4 rows 2 KiB ahead, as
    // scaled_block prefetches its four rows: eight streams from memory at 0.8x the rate).
    const int64_t at = value_bytes(w[0], l);
    if (at % 64 == 0)
      for (int i = 0; i < TW; ++i)
        __builtin_prefetch(reinterpret_cast<const char*>(w[i]) + at + value_bytes(w[0], 1024),
                           0, 3);
    if (l + kLine <= c0 + blk) {
#if defined(__AVX512VBMI__)
      if constexpr (!kNibbles<Q>) {  // int8 and FP8 rows: byte permutes
        byte_pair_line<Huge, TP, TR, Q>(reinterpret_cast<const uint8_t* const*>(w), x, l, table,
                                        acc);
        continue;
      }
#endif
#pragma GCC unroll 16
      for (int64_t c = 0; c < kLine; c += 8) step(l + c);
    } else {
      for (int64_t c = l; c < c0 + blk; c += 8) step(c);
    }
  }
}

// TR inputs against 2 TP kRowPairs rows (w[0 .. 2 TP)), rows 2p and 2p + 1 side by side in
// the halves of a 512-bit vector, each half the 8-lane sum `dots` makes of its row and input:
// sixteen weights of two rows are made by one 512-bit operation where 8-lane steps take two.
// out[i * TR + j] = dot(w[i], x[j]), as `dots`.
template <int TP, int TR, typename Q>
inline void row_pair_dots(const Q* const* w, const float* const* x, int64_t L, int64_t blk,
                          float* out) {
  constexpr int TW = 2 * TP;
  v16 acc[TP][TR];
  for (int p = 0; p < TP; ++p)
    for (int j = 0; j < TR; ++j) acc[p][j] = v16{};
  const int64_t vb = value_bytes(w[0], L), nb = L / blk;
  for (int64_t c0 = 0; c0 < L; c0 += blk) {
    // Int4: row i's block's sixteen weights (block_table: one operation). Int8: pair p's
    // scales, then its offsets, a row's in each half. Both broadcast from memory, a load each
    // and no arithmetic (from a register, each broadcast took a shuffle: int4 calls at one row
    // took 0.92x-0.95x the time without them, docs/kernels.md, "Block tables from memory").
    // FP8: pair p's scales (folded as scaled8 takes them, unless a scale of the tile is too
    // big: then every row's two steps, the same bits).
    __m512 table[TW];
    const int64_t k = c0 / blk;
    const auto held = [&](int i, int64_t at) {  // float `at` of row i's scales and offsets
      return reinterpret_cast<const float*>(reinterpret_cast<const char*>(w[i]) + vb) + at;
    };
    bool huge = false;
    if constexpr (kNibbles<Q>) {
      for (int i = 0; i < TW; ++i) table[i] = block_table(w[i], vb, nb, k);
    } else if constexpr (kOffsets<Q>) {
      for (int i = 0; i < TW; i += 2)
        for (int t = 0; t < 2; ++t)  // scales, then offsets
          table[i + t] = _mm512_mask_broadcastss_ps(
              _mm512_broadcastss_ps(_mm_load_ss(held(i, t * nb + k))), 0xff00,
              _mm_load_ss(held(i + 1, t * nb + k)));
    } else {
      float s[TW];
      for (int i = 0; i < TW; ++i) {
        std::memcpy(&s[i], held(i, k), sizeof s[i]);
        huge = huge || too_big(w[i], s[i]);
      }
      for (int i = 0; i < TW; i += 2) {
        const auto scale = [&](int r) {
          return _mm512_set1_ps(huge ? s[r] : s[r] * folded(w[r]));
        };
        table[i] = _mm512_mask_mov_ps(scale(i), 0xff00, scale(i + 1));
        table[i + 1] = _mm512_setzero_ps();  // (unused)
      }
    }
    if (huge)
      row_pair_block<true, TP, TR>(w, x, c0, blk, L, table, acc);
    else
      row_pair_block<false, TP, TR>(w, x, c0, blk, L, table, acc);
  }
  v8 half[TW * TR];
  for (int p = 0; p < TP; ++p)
    for (int j = 0; j < TR; ++j) {
      const __m512 v = reinterpret_cast<__m512>(acc[p][j]);
      half[2 * p * TR + j] = reinterpret_cast<v8>(_mm512_castps512_ps256(v));
      half[(2 * p + 1) * TR + j] = reinterpret_cast<v8>(_mm512_extractf32x8_ps(v, 1));
    }
  hsums<TW * TR>(half, out);
}
#endif

// Columns [c0, c0 + blk) of one scaled row (its values, then L / blk scales; the values take
// vb bytes) as float32 into out: each value times its block's scale, exactly as `dots`
// widens it in registers.
template <typename Q>
__attribute__((always_inline)) inline void widen_block(const Q* w, int64_t c0, int64_t blk,
                                                       int64_t vb, int64_t nb, float* out) {
  float s;
  std::memcpy(&s, reinterpret_cast<const char*>(w) + vb + 4 * (c0 / blk), sizeof s);
  const bool huge = too_big(w, s);
  const v8 scale = v8{} + (huge ? s : s * folded(w));
  v8 offset = scale;
  if constexpr (kOffsets<Q>) offset = v8{} + block_offset(w, vb, nb, c0 / blk);
#if defined(__AVX512F__) && defined(__AVX512VL__)
  if constexpr (kNibbles<Q>) {
    const __m512 table = block_table(w, vb, nb, c0 / blk);
    if (lane_major(blk, nb * blk)) {
      lane_pieces(c0, blk, [&](int64_t g, auto first, auto steps) __attribute__((always_inline)) {
        constexpr int s0 = decltype(first)::value, s1 = s0 + decltype(steps)::value;
#pragma GCC unroll 4
        for (int s = s0; s < s1; s += 2) {
          const v16 v = looked_up16<true>(w, g + 8 * s, table);
          std::memcpy(out + g + 8 * s, &v, sizeof v);
        }
      });
      return;
    }
    int64_t c = c0;
    for (; c + 16 <= c0 + blk; c += 16) {
      const v16 v = looked_up16<false>(w, c, table);
      std::memcpy(out + c, &v, sizeof v);
    }
    for (; c < c0 + blk; c += 8) {
      const v8 v = looked_up8<false>(w, c, table);
      std::memcpy(out + c, &v, sizeof v);
    }
    return;
  } else if (blk % 16 == 0) {  // sixteen at a time: the same operations on every lane
    const v16 s16 = v16{} + scale[0], o16 = v16{} + offset[0];
    for (int64_t c = c0; c < c0 + blk; c += 16) {
      const v16 v = huge ? scaled16<true>(w, c, s16, o16) : scaled16<false>(w, c, s16, o16);
      std::memcpy(out + c, &v, sizeof v);
    }
    return;
  }
#endif
  if (kNibbles<Q> && lane_major(blk, nb * blk)) {  // int4 rows held lane by lane
    lane_pieces(c0, blk, [&](int64_t g, auto first, auto steps) __attribute__((always_inline)) {
      constexpr int s0 = decltype(first)::value, s1 = s0 + decltype(steps)::value;
#pragma GCC unroll 8
      for (int s = s0; s < s1; ++s) {
        const v8 v = scaled8<false, true>(w, g + 8 * s, scale, offset);
        std::memcpy(out + g + 8 * s, &v, sizeof v);
      }
    });
    return;
  }
  for (int64_t c = c0; c < c0 + blk; c += 8) {
    const v8 v = huge ? scaled8<true>(w, c, scale, offset) : scaled8<false>(w, c, scale, offset);
    std::memcpy(out + c, &v, sizeof v);
  }
}

// Int8 and FP8 rows of more bytes than this fetch the next row of their share of the matrix
// into L2 as they are widened, a share with each block (widen_row), so that the fetches spread
// over the widening: fetched all at once after the tile's rows were widened, a core's tiles
// over int8 rows of 2048 columns ran from DRAM at 0.8 of their rate from L2, so at 0.91.
// Shorter rows and int4 rows (half the bytes: 0.95-1.04x the time at 2048 columns, 1.05-1.19x
// at 768) are still fetched after the tile's rows are widened.
constexpr int64_t kSpreadFetch = 512;

template <typename T>
constexpr bool spread_fetch(int64_t row_bytes) {
  return !kNibbles<T> && row_bytes > kSpreadFetch;
}

// out[0 .. L) = one scaled row widened (widen_block); `next`, if given, the next_bytes of the
// row to be widened after it: fetched into L2 a share with each block.
template <typename Q>
inline void widen_row(const Q* w, int64_t L, int64_t blk, float* out,
                      const char* next = nullptr, int64_t next_bytes = 0) {
  const int64_t vb = value_bytes(w, L), nb = L / blk;
  if (!next) {
    for (int64_t c0 = 0; c0 < L; c0 += blk) widen_block(w, c0, blk, vb, nb, out);
    return;
  }
  const int64_t share = (next_bytes + nb - 1) / nb;
  int64_t fetched = 0;  // bytes of `next` fetched, whole cache lines
  for (int64_t c0 = 0; c0 < L; c0 += blk) {
    for (const int64_t end = std::min(next_bytes, (c0 / blk + 1) * share); fetched < end;
         fetched += 64)
      __builtin_prefetch(next + fetched, 0, 2);
    widen_block(w, c0, blk, vb, nb, out);
  }
}

// Rows rows[0 .. TW) of W (ld elements apart, scaled rows of L values) widened into wide, L
// floats each; where `more`, the row after each fetched into L2 for the next tile, as they
// widen or after them (kSpreadFetch): widen_row reads its rows once, before any arithmetic,
// and would otherwise wait on DRAM for each of them. (Float32 rows need no such step: their
// tiles prefetch as they go.)
template <int TW, typename T>
__attribute__((always_inline)) inline void widen_tile(const T* W, const int64_t* rows,
                                                      int64_t ld, int64_t L, int64_t blk,
                                                      float* wide, bool more) {
  const int64_t row_bytes = ld * static_cast<int64_t>(sizeof(T));
  const bool spread = more && spread_fetch<T>(row_bytes);
  for (int i = 0; i < TW; ++i) {
    const T* next = spread ? W + (rows[i] + 1) * ld : nullptr;
    widen_row(W + rows[i] * ld, L, blk, wide + i * L, reinterpret_cast<const char*>(next),
              row_bytes);
  }
  if (more && !spread)
    for (int i = 0; i < TW; ++i) {
      const char* next = reinterpret_cast<const char*>(W + (rows[i] + 1) * ld);
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 0, 2);
    }
}

// Room for n floats in this thread's `buf`, from a 64-byte boundary: rows widened there (and
// read back eight or sixteen columns at a time) then never straddle a cache line where L is a
// multiple of 16.
inline float* aligned_floats(std::vector<float>& buf, int64_t n) {
  buf.resize(n + 16);
  return on_cache_line(buf.data());
}

// Apply the rows w[0..R) of a [R, L] matrix (rows `ld` floats apart) to `r` inputs x[j]
// (length L): emit(row, j, value) for every row and input. The TW rows of a tile are about a
// quarter (or a third, or an eighth) of the matrix apart (an odd number of rows: stream_gap),
// not neighbours: streams that far apart are prefetched in parallel, and short rows stream
// faster than from TW adjacent rows.
// RowPairs: the tiles are row_pair_dots' (kRowPairs rows, AVX-512 builds), TW / 2 pairs, an
// eighth (or a sixth) of the matrix apart: scaled rows, whose scales make the distance no
// power of two.
template <int TW, int TR, bool RowPairs = false, typename T, typename Emit>
inline void matvecs_tile(const T* W, int64_t R, int64_t L, int64_t ld, const float* const* x,
                         Emit emit, int64_t blk) {
  float out[TW * TR];
  const T* w[TW];
  const int64_t gap = RowPairs ? R / TW : stream_gap(R, TW);
  for (int64_t row = 0; row < gap; ++row) {
    for (int i = 0; i < TW; ++i) w[i] = W + (row + i * gap) * ld;
    if constexpr (RowPairs) {
#if COLIBRI_ROW_PAIRS
      row_pair_dots<TW / 2, TR>(w, x, L, blk, out);
#else
      static_assert(!RowPairs, "row pairs only where COLIBRI_ROW_PAIRS");
#endif
    } else {
      dots<TW, TR>(w, x, L, out, blk);
    }
    for (int i = 0; i < TW; ++i)
      for (int j = 0; j < TR; ++j) emit(row + i * gap, j, out[i * TR + j]);
  }
  for (int64_t row = gap * TW; row < R; ++row) {
    w[0] = W + row * ld;
    dots<1, TR>(w, x, L, out, blk);
    for (int j = 0; j < TR; ++j) emit(row, j, out[j]);
  }
}

// out[i * TR + j] = dot(w[i], x[j0 + j]), emitted as emit(rows[i], j0 + j, ...).
template <int TW, int TR, typename T, typename Emit>
inline void tile(const T* const* w, const int64_t* rows, const float* const* x, int64_t j0,
                 int64_t L, Emit& emit, int64_t blk) {
  float out[TW * TR];
  dots<TW, TR>(w, x + j0, L, out, blk);
  for (int i = 0; i < TW; ++i)
    for (int j = 0; j < TR; ++j) emit(rows[i], j0 + j, out[i * TR + j]);
}

// Every input (more than four) against rows w[0..TW): in tiles of four and three inputs
// (five: three and two), never of one or two where three can be had: a pass over the rows
// then makes 12 or 9 sums instead of 3 or 6 (9 inputs as 3 + 3 + 3, not 4 + 4 + 1).
template <int TW, typename T, typename Emit>
inline void all_inputs(const T* const* w, const int64_t* rows, const float* const* x,
                       int64_t r, int64_t L, Emit& emit, int64_t blk) {
  if (r == 5) {
    tile<TW, 3>(w, rows, x, 0, L, emit, blk);
    tile<TW, 2>(w, rows, x, 3, L, emit, blk);
    return;
  }
  const int64_t threes = (4 - r % 4) % 4;  // r = 4 * fours + 3 * threes
  int64_t j0 = 0;
  for (; j0 + 3 * threes < r; j0 += 4) tile<TW, 4>(w, rows, x, j0, L, emit, blk);
  for (; j0 < r; j0 += 3) tile<TW, 3>(w, rows, x, j0, L, emit, blk);
}

// Up to four inputs: one pass of matvecs_tile. More: each tile of three weight rows meets
// every input, four (or three) at a time, while it is in L1 (a pass over the matrix for every
// four inputs would re-read the weights from L2).
// Three weight rows by four inputs keep 12 sums, 3 weight vectors and 1 input vector in the 16
// AVX registers.
// `ld`: elements from one row of W to the next (default L); `blk`: FP8 rows' block width.
template <typename T, typename Emit>
void matvecs(const T* W, int64_t R, int64_t L, const float* const* x, int64_t r, Emit emit,
             int64_t ld = 0, int64_t blk = 0) {
  if (ld == 0) ld = L;
  if (r <= 0) return;
#if COLIBRI_ROW_PAIRS
  if constexpr (COLIBRI_HELD_PAIRS && kRowPairs<T>) {
    if (r == 1) return matvecs_tile<8, 1, true>(W, R, L, ld, x, emit, blk);
    if (r == 2) return matvecs_tile<8, 2, true>(W, R, L, ld, x, emit, blk);
    if (r == 3) return matvecs_tile<6, 3, true>(W, R, L, ld, x, emit, blk);
    if (r == 4) return matvecs_tile<6, 4, true>(W, R, L, ld, x, emit, blk);
  }
#endif
  if (r == 4) return matvecs_tile<3, 4>(W, R, L, ld, x, emit, blk);
  if (r == 3) return matvecs_tile<3, 3>(W, R, L, ld, x, emit, blk);
  if (r == 2) return matvecs_tile<4, 2>(W, R, L, ld, x, emit, blk);
  if (r == 1) return matvecs_tile<4, 1>(W, R, L, ld, x, emit, blk);
  const int64_t gap = stream_gap(R, 3);  // rows a third of the matrix apart, as in matvecs_tile
  if constexpr (kScaled<T>) {
    // Scaled rows met by several tiles of inputs: each widened once, into float32 rows in L1,
    // which the float32 tiles then read (the same values, the same multiply-adds).
    thread_local std::vector<float> buf;
    float* const wide = aligned_floats(buf, 3 * L);
    const float* w[3] = {wide, wide + L, wide + 2 * L};
    int64_t rows[3];
    for (int64_t row = 0; row < gap; ++row) {
      for (int i = 0; i < 3; ++i) rows[i] = row + i * gap;
      widen_tile<3>(W, rows, ld, L, blk, wide, row + 1 < gap);
      all_inputs<3>(w, rows, x, r, L, emit, 0);
    }
    for (int64_t row = gap * 3; row < R; ++row) {
      widen_row(W + row * ld, L, blk, wide);
      all_inputs<1>(w, &row, x, r, L, emit, 0);
    }
  } else {
    const T* w[3];
    int64_t rows[3];
    for (int64_t row = 0; row < gap; ++row) {
      for (int i = 0; i < 3; ++i) {
        rows[i] = row + i * gap;
        w[i] = W + rows[i] * ld;
      }
      all_inputs<3>(w, rows, x, r, L, emit, blk);
    }
    for (int64_t row = gap * 3; row < R; ++row) {
      w[0] = W + row * ld;
      all_inputs<1>(w, &row, x, r, L, emit, blk);
    }
  }
}

}  // namespace
