// Bfloat16 products (colibri_linear_bf16p, colibri_moe_experts_bf16p): bfloat16 weights times
// inputs rounded to bfloat16, summed in float32. This is the arithmetic of AVX-512 BF16's
// VDPBF16PS, used where the build has it (twice the multiply-adds of a float32 FMA an
// instruction, no widening); elsewhere an emulation gives the same bits.
//
// The order, whatever the build: a dot product over L columns is 16 float32 lanes advanced
// over chunks of 32 columns, lane l taking columns 2l + 1 and then 2l of each chunk, each a
// multiply-add rounded once (a product of two bfloat16 values is exact in float32); then the
// two halves of the lanes added (lanes l and l + 8) and summed in hsum's order; then the last
// L % 32 columns one by one. Inputs are rounded to nearest-even (`round_bf16`). Values below
// 2^-126 count as zero, inputs and results alike: the instruction's rule, which the callers
// follow everywhere by running these kernels with DAZ and FTZ set (`FlushSubnormals`).
// A row's result depends only on its input and its weights (cpu.cc, "Exactness").

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "formats.h"
#include "simd.h"

namespace {

// Subnormal inputs and results taken as zero while it lives, on this thread (DAZ and FTZ).
struct FlushSubnormals {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  FlushSubnormals() { _mm_setcsr(saved | 0x8040u); }
  ~FlushSubnormals() { _mm_setcsr(saved); }
#endif
};

// A float32 rounded to the nearest bfloat16, ties to even; subnormals to a zero of their sign,
// NaNs to quiet NaNs (as VCVTNE2PS2BF16 rounds).
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0) return static_cast<uint16_t>((u >> 16) & 0x8000u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// out[0 .. L) = x[0 .. L) rounded to bfloat16.
inline void round_row(const float* x, int64_t L, uint16_t* out) {
  int64_t c = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  for (; c + 32 <= L; c += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + c + 16), _mm512_loadu_ps(x + c));
    _mm512_storeu_si512(out + c, reinterpret_cast<__m512i>(b));
  }
#endif
  for (; c < L; ++c) out[c] = round_bf16(x[c]);
}

inline float bf16_value(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)

// 16 lanes of sums; 32 bfloat16 values.
typedef __m512 BAcc;
typedef __m512i BVec;

inline BAcc bzero() { return _mm512_setzero_ps(); }
inline BVec bload(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline void bfma(BAcc& acc, const BVec& w, const BVec& x) {
  acc = _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(w), reinterpret_cast<__m512bh>(x));
}
// Lanes l + lanes l + 8.
inline v8 bfold(const BAcc& a) {
  const __m256 lo = _mm512_castps512_ps256(a), hi = _mm512_extractf32x8_ps(a, 1);
  return reinterpret_cast<v8>(_mm256_add_ps(lo, hi));
}

#else

typedef uint32_t u8v __attribute__((vector_size(32)));

// Lanes 0-7 and 8-15 of the sums; the values of columns 2l + 1 (odd) and 2l (even) of each
// half, widened.
struct BAcc {
  v8 lo, hi;
};
struct BVec {
  v8 odd_lo, even_lo, odd_hi, even_hi;
};

inline BAcc bzero() { return {v8{}, v8{}}; }
inline BVec bload(const uint16_t* p) {
  u8v a, b;
  std::memcpy(&a, p, sizeof a);
  std::memcpy(&b, p + 16, sizeof b);
  const u8v top = a - a + 0xffff0000u;
  return {reinterpret_cast<v8>(a & top), reinterpret_cast<v8>(a << 16),
          reinterpret_cast<v8>(b & top), reinterpret_cast<v8>(b << 16)};
}
inline void bfma(BAcc& acc, const BVec& w, const BVec& x) {
  acc.lo = fma8(w.even_lo, x.even_lo, fma8(w.odd_lo, x.odd_lo, acc.lo));
  acc.hi = fma8(w.even_hi, x.even_hi, fma8(w.odd_hi, x.odd_hi, acc.hi));
}
inline v8 bfold(const BAcc& a) { return a.lo + a.hi; }

#endif

// out[i * TR + j] = the bfloat16 product of weight row w[i] and input x[j] over L columns,
// for TW weight rows and TR inputs (both rows of bfloat16 bits). `next`: where the rows after
// these are (`ld` weights on), prefetched column by column as the tile goes, for a tile that
// meets rows already in L1 (the second of two tiles over the same rows); else, for tiles of
// several inputs, each row's stream 4 KiB ahead into L2 (one input streams fast without).
template <int TW, int TR>
inline void bdots(const uint16_t* const* w, const uint16_t* const* x, int64_t L, float* out,
                  int64_t next = 0) {
  BAcc acc[TW][TR];
  for (int i = 0; i < TW; ++i)
    for (int j = 0; j < TR; ++j) acc[i][j] = bzero();
  const int64_t L32 = L / 32 * 32;
  for (int64_t c = 0; c < L32; c += 32) {
    if (next)
      for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + next + c, 0, 3);
    else if (TR > 1)
      for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + c + 2048, 0, 2);
    BVec wv[TW];
    for (int i = 0; i < TW; ++i) wv[i] = bload(w[i] + c);
    for (int j = 0; j < TR; ++j) {
      const BVec xv = bload(x[j] + c);
      for (int i = 0; i < TW; ++i) bfma(acc[i][j], wv[i], xv);
    }
  }
  v8 folded[TW * TR];
  for (int i = 0; i < TW; ++i)
    for (int j = 0; j < TR; ++j) folded[i * TR + j] = bfold(acc[i][j]);
  hsums<TW * TR>(folded, out);
  if (L32 < L)
    for (int i = 0; i < TW; ++i)
      for (int j = 0; j < TR; ++j) {
        float s = out[i * TR + j];
        for (int64_t t = L32; t < L; ++t) s = std::fma(bf16_value(w[i][t]), bf16_value(x[j][t]), s);
        out[i * TR + j] = s;
      }
}

// Rows w[0 .. TW) (indices `rows`) against inputs x[j0 .. j0 + TR): emit(row, j, value).
template <int TW, int TR, typename Emit>
inline void btile(const uint16_t* const* w, const int64_t* rows, const uint16_t* const* x,
                  int64_t j0, int64_t L, Emit& emit, int64_t next) {
  float out[TW * TR];
  bdots<TW, TR>(w, x + j0, L, out, next);
  for (int i = 0; i < TW; ++i)
    for (int j = 0; j < TR; ++j) emit(rows[i], j0 + j, out[i * TR + j]);
}

// Inputs x[j0 .. j0 + n), n from 1 to 8, against rows w[0 .. TW).
template <int TW, typename Emit>
inline void btiles(const uint16_t* const* w, const int64_t* rows, const uint16_t* const* x,
                   int64_t j0, int64_t n, int64_t L, Emit& emit, int64_t next) {
  switch (n) {
#define COLIBRI_BTILE(k)                         \
  case k:                                        \
    btile<TW, k>(w, rows, x, j0, L, emit, next); \
    break;
    COLIBRI_BTILE(1) COLIBRI_BTILE(2) COLIBRI_BTILE(3) COLIBRI_BTILE(4)
    COLIBRI_BTILE(5) COLIBRI_BTILE(6) COLIBRI_BTILE(7) COLIBRI_BTILE(8)
#undef COLIBRI_BTILE
  }
}

// Rows w[0 .. TW) against all r inputs, in tiles of up to eight inputs as even as can be
// (9: 4 + 5), while the rows are in L1; the tiles after the first fetch the next rows (`ld`
// weights on) meanwhile, so that the stream from memory goes on while they compute.
template <int TW, typename Emit>
inline void ball_inputs(const uint16_t* const* w, const int64_t* rows, const uint16_t* const* x,
                        int64_t r, int64_t L, int64_t ld, Emit& emit) {
  const int64_t tiles = (r + 7) / 8;
  for (int64_t t = 0, j0 = 0; t < tiles; ++t) {
    const int64_t n = (r - j0) / (tiles - t);
    btiles<TW>(w, rows, x, j0, n, L, emit, t > 0 ? ld : 0);
    j0 += n;
  }
}

// Apply the rows of W [R, L] (rows `ld` weights apart) to r inputs x[j] (bfloat16 rows of L):
// emit(row, j, value) for every row and input. The TW rows of a tile are about R / TW apart
// (stream_gap, as in tiles.h): four rows for one or two inputs (four streams), three for more
// (3 x 8 sums, three weight vectors and an input in AVX-512's 32 registers).
template <typename Emit>
void bmatvecs(const Bf16P* W, int64_t R, int64_t L, int64_t ld, const uint16_t* const* x,
              int64_t r, Emit emit) {
  if (r <= 0) return;
  const uint16_t* base = reinterpret_cast<const uint16_t*>(W);
  auto walk = [&](auto tw) {
    constexpr int TW = decltype(tw)::value;
    const int64_t gap = stream_gap(R, TW);
    const uint16_t* w[TW];
    int64_t rows[TW];
    for (int64_t row = 0; row < gap; ++row) {
      for (int i = 0; i < TW; ++i) {
        rows[i] = row + i * gap;
        w[i] = base + rows[i] * ld;
      }
      ball_inputs<TW>(w, rows, x, r, L, ld, emit);
    }
    for (int64_t row = gap * TW; row < R; ++row) {
      w[0] = base + row * ld;
      ball_inputs<1>(w, &row, x, r, L, ld, emit);
    }
  };
  if (r <= 2)
    walk(std::integral_constant<int, 4>{});
  else
    walk(std::integral_constant<int, 3>{});
}

}  // namespace
