// colibri_fma_peak: the multiply-add rate one core reaches, the ceiling the tiles' arithmetic
// is measured against; colibri_read_sum: a core reading memory with nothing else to do, the
// bandwidth the decode steps are measured against (colibri/bench/bandwidth.py).

#pragma once

#include <chrono>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

// Twelve independent chains of multiply-adds, enough in flight to cover the latency of two
// pipes; `fma(a, b, c)` one vector instruction of `Lanes` multiply-adds. GFLOP/s, two each.
template <int Lanes, typename B, typename V, typename Fma>
double fma_chains(B one, V tiny, Fma fma, double seconds) {
  V a[12];
  for (int i = 0; i < 12; ++i) a[i] = tiny;
  const auto start = std::chrono::steady_clock::now();
  int64_t rounds = 0;
  double spent = 0;
  do {
    for (int k = 0; k < 100000; ++k) {
      for (int i = 0; i < 12; ++i) a[i] = fma(a[i], one, tiny);
      // The results used, so that the chains are computed, and kept in registers.
      asm volatile("" ::"v"(a[0]), "v"(a[1]), "v"(a[2]), "v"(a[3]), "v"(a[4]), "v"(a[5]),
                   "v"(a[6]), "v"(a[7]), "v"(a[8]), "v"(a[9]), "v"(a[10]), "v"(a[11]));
    }
    rounds += 100000;
    spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (spent < seconds);
  return rounds * 12.0 * 2 * Lanes / spent / 1e9;
}

}  // namespace

// GFLOP/s of multiply-adds on vectors of `lanes` floats (8: 256-bit, 16: 512-bit) on the
// calling thread, measured for about `seconds`; 0 where the build has no such instruction.
extern "C" double colibri_fma_peak(int32_t lanes, double seconds) {
#if defined(__FMA__)
  if (lanes == 8)
    return fma_chains<8>(_mm256_set1_ps(1.0f), _mm256_set1_ps(1e-3f),
                         [](__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); },
                         seconds);
#endif
#if defined(__AVX512F__)
  if (lanes == 16)
    return fma_chains<16>(_mm512_set1_ps(1.0f), _mm512_set1_ps(1e-3f),
                          [](__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); },
                          seconds);
#endif
  (void)lanes;
  (void)seconds;
  return 0;
}

// GFLOP/s of bfloat16 dot products (VDPBF16PS on 512-bit vectors: 32 multiply-adds an
// instruction) on the calling thread, the ceiling of bf16p.h's tiles; 0 where the build has
// no such instruction.
extern "C" double colibri_bf16_dot_peak(double seconds) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const __m512bh ones = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));  // 1.0
  return fma_chains<32>(ones, _mm512_set1_ps(1e-3f),
                        [](__m512 a, __m512bh b, __m512) { return _mm512_dpbf16_ps(a, b, b); },
                        seconds);
#else
  (void)seconds;
  return 0;
#endif
}

// Sum of the n floats at p in eight 8-lane sums, nothing else done with them: a core reading
// memory as fast as it can, the read rate the roofline probe takes (colibri/bench/bandwidth.py).
extern "C" float colibri_read_sum(const float* p, int64_t n) {
  v8 a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 += load8(p + i), a1 += load8(p + i + 8), a2 += load8(p + i + 16);
    a3 += load8(p + i + 24), a4 += load8(p + i + 32), a5 += load8(p + i + 40);
    a6 += load8(p + i + 48), a7 += load8(p + i + 56);
  }
  const v8 sum = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
  float s = 0;
  for (int k = 0; k < 8; ++k) s += sum[k];
  for (; i < n; ++i) s += p[i];
  return s;
}
