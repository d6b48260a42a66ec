// Eight-lane float32 vectors (sixteen in AVX-512 builds) and the arithmetic every kernel
// shares: loads, spelled-out multiply-adds, the fixed horizontal sums, and e^x and silu lane by
// lane.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

typedef float v8 __attribute__((vector_size(32)));

// The first float at or after p on a 64-byte boundary (a cache line): buffers kept with 16
// floats to spare start their rows or packed inputs there, so that no 512-bit load of them
// straddles two lines.
inline float* on_cache_line(float* p) {
  return p + (64 - reinterpret_cast<uintptr_t>(p) % 64) % 64 / sizeof(float);
}

// Eight floats from p on, one unaligned load: a memcpy into an array of vectors GCC made, in
// AVX2 builds, two 16-byte copies through the stack and a 32-byte load of them, which waited
// on the copies (attention's values tiles at a tenth of their rate).
inline v8 load8(const float* p) {
#if defined(__AVX__)
  return reinterpret_cast<v8>(_mm256_loadu_ps(p));
#else
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// Multiply-adds are spelled out (the library is built with -ffp-contract=off), so every
// instantiation of a loop rounds the same way.
#if defined(__FMA__)
inline v8 fma8(v8 a, v8 b, v8 c) {
  return reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a),
                                              reinterpret_cast<__m256>(b),
                                              reinterpret_cast<__m256>(c)));
}
#else
inline v8 fma8(v8 a, v8 b, v8 c) { return a * b + c; }
#endif

// Pin a loaded vector in a register. Without it GCC folds the loads into the FMAs and repeats
// them for every pair of the tile (12 loads instead of 6 for 8 FMAs in a 2x4 tile).
inline void in_register(v8& v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#endif
}

#if defined(__AVX512F__)
// Sixteen lanes (AVX-512 builds): two 8-lane sums side by side (pairs.h, tiles.h's int4 rows).
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) { return reinterpret_cast<v16>(_mm512_loadu_ps(p)); }

inline v16 fma16(v16 a, v16 b, v16 c) {
  return reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                               reinterpret_cast<__m512>(b),
                                               reinterpret_cast<__m512>(c)));
}

inline void in_register(v16& v) { asm("" : "+v"(v)); }
#endif

inline float hsum(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline v8 max8(v8 a, v8 b) { return a > b ? a : b; }

// *p in every lane of a V (splat(V{}, p)), loaded straight into the vector: a broadcast from
// memory, a load's work, where `V{} + *p` is an add to zero and a shuffle, the shuffle on a
// multiply-add's port.
inline v8 splat(v8, const float* p) {
#if defined(__AVX__)
  return reinterpret_cast<v8>(_mm256_broadcast_ss(p));
#else
  return v8{} + *p;
#endif
}

#if defined(__AVX512F__)
inline v16 splat(v16, const float* p) { return reinterpret_cast<v16>(_mm512_set1_ps(*p)); }
#endif

// A V of the floats from p on (vector(V{}, p)): load8 or load16.
inline v8 vector(v8, const float* p) { return load8(p); }

#if defined(__AVX512F__)
inline v16 vector(v16, const float* p) { return load16(p); }
#endif

// v's floats to p on, one unaligned store: a memcpy from an array of 8-lane sums made GCC, in
// AVX2 builds, keep the array on the stack and store every sum to it at every step of the loop
// that advanced them, then copy it out in 16-byte halves (attention's values tiles at a third
// of the multiply-add ceiling).
inline void store(float* p, v8 v) {
#if defined(__AVX__)
  _mm256_storeu_ps(p, reinterpret_cast<__m256>(v));
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

#if defined(__AVX512F__)
inline void store(float* p, v16 v) { _mm512_storeu_ps(p, reinterpret_cast<__m512>(v)); }
#endif

// out[0 .. N) = hsum(acc[i]) for N accumulators, bitwise as hsum computes each: with AVX,
// eight at a time in vector registers (pairs of halves, then two rounds of pairwise adds)
// instead of lane by lane through memory, which cost as much as the products of a short dot.
// Always inlined: with more kernels in this file GCC stopped inlining the small ones, which
// slowed the 16-row calls.
template <int N>
__attribute__((always_inline)) inline void hsums(const v8* acc, float* out) {
#if defined(__AVX__)
  constexpr int P = (N + 7) / 8 * 8;
  __m256 a[P];
  for (int i = 0; i < P; ++i)
    a[i] = i < N ? reinterpret_cast<const __m256&>(acc[i]) : _mm256_setzero_ps();
  for (int g = 0; g < P; g += 8) {
    __m256 h[4];  // h[k] = [a(2k): v0+v4, v1+v5, v2+v6, v3+v7 | a(2k+1): the same]
    for (int k = 0; k < 4; ++k) {
      const __m256 x = a[g + 2 * k], y = a[g + 2 * k + 1];
      h[k] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20),
                           _mm256_permute2f128_ps(x, y, 0x31));
    }
    // ((v0+v4) + (v1+v5)) + ((v2+v6) + (v3+v7)) of a0 a2 a4 a6 | a1 a3 a5 a7.
    const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    float r[8];
    _mm256_storeu_ps(r, q);
    for (int i = 0; i < 8; ++i) {
      const int at = g + (i < 4 ? 2 * i : 2 * (i - 4) + 1);
      if (at < N) out[at] = r[i];
    }
  }
#else
  for (int i = 0; i < N; ++i) out[i] = hsum(acc[i]);
#endif
}

#if defined(__AVX512F__)
// out[2 k + h] = hsum(half h of acc[k]) for N vectors of two 8-lane sums each, bitwise as hsum
// computes each: sixteen at a time in 512-bit registers (sums of 128-bit quarters, then two
// rounds of pairwise adds within them, then one permute into order) instead of each half
// taken out and summed eight at a time, which cost as much as the products of a short dot.
template <int N>
__attribute__((always_inline)) inline void pair_hsums(const v16* acc, float* out) {
  static_assert(N > 0, "pair_hsums of no vectors");
  // Sum d of a group ends up at 4 (d % 4) + d / 4 of the last round's vector.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int g = 0; g < N; g += 8) {
    __m512 a[8];
    for (int i = 0; i < 8; ++i)
      a[i] = g + i < N ? reinterpret_cast<const __m512&>(acc[g + i]) : _mm512_setzero_ps();
    __m512 z[4], w[2];
    for (int m = 0; m < 4; ++m)  // quarter q of z[m]: lanes k + 4 of sum 4 m + q added to lanes k
      z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; ++m)
      w[m] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 r = _mm512_permutexvar_ps(
        order, _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1))));
    if (g + 8 <= N) {
      _mm512_storeu_ps(out + 2 * g, r);
    } else {
      alignas(64) float last[16];
      _mm512_store_ps(last, r);
      for (int i = 0; i < 2 * (N - g); ++i) out[2 * g + i] = last[i];
    }
  }
}
#endif

// k rounded to the nearest integer, ties to even, lane by lane.
inline v8 round_lanes(v8 k) {
#if defined(__AVX__)
  return reinterpret_cast<v8>(_mm256_round_ps(reinterpret_cast<__m256>(k),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < 8; ++i) k[i] = std::nearbyint(k[i]);
  return k;
#endif
}

inline v8 fma_lanes(v8 a, v8 b, v8 c) { return fma8(a, b, c); }

#if defined(__AVX512F__)
inline v16 round_lanes(v16 k) {
  return reinterpret_cast<v16>(_mm512_roundscale_ps(reinterpret_cast<__m512>(k),
                                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline v16 fma_lanes(v16 a, v16 b, v16 c) { return fma16(a, b, c); }
#endif

// e^x lane by lane (V: v8, or v16 in AVX-512 builds, the same operations on every lane, so
// the same bits whatever the width): x = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts),
// e^r by a degree-6 polynomial (relative error ~1e-7), times 2^k put together in the exponent
// bits. Below -87, where floats turn subnormal, the result is 0, as for -inf; above 88 it is
// e^88.
template <typename V>
inline V exp_lanes(V x) {
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  const V lo = V{} - 87.0f, hi = V{} + 88.0f;
  const I keep = x >= lo;
  x = x > lo ? x : lo;
  x = x < hi ? x : hi;
  const V k = round_lanes(x * 1.44269504088896341f);
  V r = fma_lanes(k, V{} - 0.693359375f, x);
  r = fma_lanes(k, V{} + 2.12194440e-4f, r);
  V q = V{} + 1.9875691500e-4f;
  q = fma_lanes(q, r, V{} + 1.3981999507e-3f);
  q = fma_lanes(q, r, V{} + 8.3334519073e-3f);
  q = fma_lanes(q, r, V{} + 4.1665795894e-2f);
  q = fma_lanes(q, r, V{} + 1.6666665459e-1f);
  q = fma_lanes(q, r, V{} + 5.0000001201e-1f);
  const V y = fma_lanes(q, r * r, r) + 1.0f;
  const I two_k = (__builtin_convertvector(k, I) + 127) << 23;
  return reinterpret_cast<V>(reinterpret_cast<I>(y * reinterpret_cast<V>(two_k)) & keep);
}

inline v8 exp8(v8 x) { return exp_lanes(x); }

// silu(g) = g / (1 + e^-g), 8 lanes.
inline v8 silu8(v8 g) { return g / (1.0f + exp8(-g)); }

// Rows between the streams of a tile of TW rows over R rows: about R / TW, and odd. Over
// streams a power of two bytes apart (a quarter of 512 rows of 2 KiB: 256 KiB; of 2048 rows of
// 8 KiB: 4 MiB) one-row calls took up to 1.3x the time of the same streams an odd number of
// rows apart on an Intel Xeon (docs/kernels.md, "Streams an odd number of rows apart"). The
// rows after TW of these go one at a time.
inline int64_t stream_gap(int64_t R, int TW) {
  const int64_t gap = R / TW;
  return gap > 1 ? (gap - 1) | 1 : gap;
}

}  // namespace
