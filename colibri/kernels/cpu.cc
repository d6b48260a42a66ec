// CPU kernels for decode, called from XLA through the typed FFI: the routed experts of a
// layer, a plain linear layer for a few rows, and attention of one new token per row.
//
// colibri_moe_experts:
//   y[n, k] = down[s] @ (silu(gate[s] @ x[n]) * (up[s] @ x[n])),  s = ids[n, k]
//
// gate, up [S, F, D], down [S, D, F], x [N, D], ids [N, K] int32 -> y [N, K, D], float32.
// Entries of ids outside [0, S) are experts that are not staged: their rows of y are 0.
// colibri_moe_experts_bf16: the same with gate, up and down as bfloat16 bit patterns (uint16),
// widened exactly to float32 as they are loaded (half the bytes read, the same results).
// colibri_moe_experts_fp8: the same with gate, up and down as FP8 rows (uint8): each row of a
// matrix is its L float8_e4m3fn values, then its L / b float32 block scales (one per b
// columns; b a multiple of 8 dividing L), so gate and up are [S, F, D + 4 D / b] and down
// [S, D, F + 4 F / b]. A weight is widened and times its block's scale (rounded once) as it is
// loaded: the float32 a block-quantized checkpoint dequantizes to, at a quarter of the bytes.
// colibri_moe_experts_int4: the same with int4 rows (int8 buffers of bytes): each row's L
// four-bit values packed two a byte (the first in the low nibble, each offset by 8), then its
// L / g float32 group scales (g a multiple of 8 dividing L), so gate and up are
// [S, F, D / 2 + 4 D / g]; a weight is its integer times its group's scale (rounded once): the
// float32 a pack-quantized checkpoint dequantizes to, at an eighth of the bytes.
// colibri_moe_experts_int4z: int4 rows with zero points (uint32 buffers, whole words a row):
// each row's L four-bit values as above, then its L / g float32 group scales s, then as many
// offsets -z s (z the group's zero point, the product exact): a weight is fma(q, s, -z s),
// (q - z) s rounded once, the float32 GPTQ's and AWQ's asymmetric weights dequantize to.
// colibri_moe_experts_int8: int8 rows (int32 buffers, whole words a row): each row's L values
// as stored, unsigned bytes, then its L / g float32 group scales s, then as many offsets -z s
// (z the zero point, 128 when symmetric): a weight is fma(q, s, -z s), as for int4z.
//
// Decode is bound by memory traffic: every weight row an expert owns is read once per call
// and multiplied against all the rows routed to that expert while it is in registers. The
// work is shared out among XLA's intra-op threads in slices of ~256-512 KiB of weights:
// first the hidden rows (gate and up) of every chosen expert, then their down projections.
//
// colibri_linear: y [M, O] = x [M, I] . w [O, I]^T; colibri_linear_bf16: w as bfloat16 bits;
// colibri_linear_fp8: w as FP8 rows [O, I + 4 I / b], colibri_linear_int4 as int4 rows
// [O, I / 2 + 4 I / g], colibri_linear_int4z as int4 rows with zero points [O, I / 8 + 2 I / g]
// words, colibri_linear_int8 as int8 rows [O, I / 4 + 2 I / g] words, as the experts above.
//
// colibri_cut_requested: whether the host asked the decode bursts running in this process to
// end after their current step (colibri_request_cut), read once per step.
//
// Exactness: every dot product is one 8-lane accumulator advanced over the vector in order,
// a fixed horizontal sum and then the scalar tail, whatever tile it is computed in, and the
// element-wise exp (softmax, SwiGLU) is one 8-lane routine whatever lane a value falls in.
// A row's output therefore depends only on its input and the expert's weights, never on how
// many other rows chose the same expert or which slot holds it: batched, chunked and staged
// results are bitwise those of the row alone.
//
// The design, and the measurements behind the choices below: docs/kernels.md.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Weights are float32, or bfloat16 held as its bit patterns (uint16_t: the top half of a
// float32). Loaded through loadw and widen, a bfloat16 weight becomes exactly the float32 it
// stands for, so a product over bfloat16 weights reads half the bytes and gives bitwise what
// the same weights widened to float32 beforehand give.
inline v8 loadw(const float* p) { return load8(p); }

inline v8 loadw(const uint16_t* p) {
#if defined(__AVX2__)
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8>(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) {
    const uint32_t bits = uint32_t{p[i]} << 16;
    std::memcpy(&v[i], &bits, sizeof bits);
  }
  return v;
#endif
}

inline float widen(float w) { return w; }

inline float widen(uint16_t w) {
  const uint32_t bits = uint32_t{w} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Eight float8_e4m3fn values (bias 7, no infinities) times 2^-120, exactly: each value's sign,
// exponent and mantissa put in place in a float32 without the bias difference (127 - 7).
// Exponent 0 (zeros, fp8 subnormals) lands on float32 subnormals, exact as long as they are
// not taken as zero (`KeepSubnormals`); the caller's scale carries the 2^120 (a product of
// exact operands, rounded once: bitwise the value times the scale). The one NaN pattern per
// sign comes out as 480 (checkpoints have none).
inline v8 e4m3x8(const uint8_t* p) {
#if defined(__AVX2__)
  int64_t eight;
  std::memcpy(&eight, p, sizeof eight);
  // Byte k into the top byte of lane k (b << 24), zeros elsewhere: in each 128-bit half the
  // shuffle picks from the same eight bytes.
  const __m256i top = _mm256_setr_epi8(
      -1, -1, -1, 0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3,  //
      -1, -1, -1, 4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7);
  const __m256i b24 = _mm256_shuffle_epi8(_mm256_set1_epi64x(eight), top);
  // Shifted back 4 with the sign copied: sign in bit 31, exponent and mantissa in bits
  // 26..20; keep those.
  const __m256i placed = _mm256_and_si256(_mm256_srai_epi32(b24, 4),
                                          _mm256_set1_epi32(static_cast<int32_t>(0x87f00000u)));
  return reinterpret_cast<v8>(_mm256_castsi256_ps(placed));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) {
    const uint32_t bits = (uint32_t{p[i]} & 0x80) << 24 | (uint32_t{p[i]} & 0x7f) << 20;
    std::memcpy(&v[i], &bits, sizeof bits);
  }
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

// A byte of int4 rows (two four-bit values, the first in the low nibble, each offset by 8).
struct Int4 {
  uint8_t byte;
};

// A byte of int4 rows with zero points: the same values, each group's scale and then its
// offset (-zero point x scale) after them.
struct Int4Z {
  uint8_t byte;
};

// A byte of int8 rows: one value, unsigned as stored; each group's scale and then its offset
// (-zero point x scale) after the row's values.
struct Int8Z {
  uint8_t byte;
};

// Weights held with per-block scales after each row's values (FP8, int4 and int8 rows).
template <typename T>
constexpr bool kScaled =
    std::is_same_v<T, uint8_t> || std::is_same_v<T, Int4> || std::is_same_v<T, Int4Z> ||
    std::is_same_v<T, Int8Z>;

// Rows that keep an offset per block after their scales (int4 rows with zero points, int8).
template <typename T>
constexpr bool kOffsets = std::is_same_v<T, Int4Z> || std::is_same_v<T, Int8Z>;

// float32s a block of scaled rows keeps after the values: its scale, and for Int4Z and Int8Z
// its offset.
inline int64_t block_floats(const void*) { return 1; }
inline int64_t block_floats(const Int4Z*) { return 2; }
inline int64_t block_floats(const Int8Z*) { return 2; }

// Bytes of L values of a row: L for FP8 and int8 (one a byte), L / 2 for int4, L * sizeof(T)
// else.
template <typename T>
inline int64_t value_bytes(const T*, int64_t L) {
  return L * static_cast<int64_t>(sizeof(T));
}
inline int64_t value_bytes(const Int4*, int64_t L) { return L / 2; }
inline int64_t value_bytes(const Int4Z*, int64_t L) { return L / 2; }
inline int64_t value_bytes(const Int8Z*, int64_t L) { return L; }

// The eight nibbles of four bytes (0 to 15, the stored values before their offset),
// exactly, as float32: each lane shifts the word right to its nibble and masks it.
inline v8 nibbles8(const void* p) {
  uint32_t word;
  std::memcpy(&word, p, sizeof word);
#if defined(__AVX2__)
  const __m256i shift = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shift),
                                       _mm256_set1_epi32(15));
  return reinterpret_cast<v8>(_mm256_cvtepi32_ps(nib));
#else
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>((word >> (4 * i)) & 15);
  return v;
#endif
}

// Eight unsigned bytes, exactly, as float32.
inline v8 bytes8(const void* p) {
#if defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
#else
  const uint8_t* b = static_cast<const uint8_t*>(p);
  v8 v;
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(b[i]);
  return v;
#endif
}

// Eight weights of a scaled row from column c: widened, times their block's scale (`scale`,
// and for FP8 the 2^120 its widening leaves out, folded into the scale unless Huge).
template <bool Huge>
inline v8 scaled8(const uint8_t* w, int64_t c, v8 scale, v8) {
  return Huge ? (e4m3x8(w + c) * 0x1p120f) * scale : e4m3x8(w + c) * scale;
}

// An int4 weight is (q - z) s rounded once; as q s - z s in one fused multiply-add (z s
// exact: 8 s, or for Int4Z the stored offset, checked exact when the rows are made) it is
// that same rounding of the same exact value, one instruction fewer. (The int4 offset is
// made here from the scale: an offset vector of its own was slower.)
template <bool Huge>
inline v8 scaled8(const Int4* w, int64_t c, v8 scale, v8) {
  return fma8(nibbles8(w + c / 2), scale, scale * -8.0f);
}
template <bool Huge>
inline v8 scaled8(const Int4Z* w, int64_t c, v8 scale, v8 offset) {
  return fma8(nibbles8(w + c / 2), scale, offset);
}
template <bool Huge>
inline v8 scaled8(const Int8Z* w, int64_t c, v8 scale, v8 offset) {
  return fma8(bytes8(w + c), scale, offset);
}

// Block k's stored offset in an Int4Z or Int8Z row (its values take vb bytes, its nb scales
// follow them); only kOffsets rows have one (int4's, -8 s, scaled8 makes from the scale).
template <typename Q>
inline float block_offset(const Q* w, int64_t vb, int64_t nb, int64_t k) {
  float o;
  std::memcpy(&o, reinterpret_cast<const char*>(w) + vb + 4 * (nb + k), sizeof o);
  return o;
}

// What scaled8 takes as a block's scale: an FP8 scale times the 2^120 its widening leaves
// out (`folded`), unless the scale is 2^8 or more (`too_big`: the product would overflow;
// Huge, two exact steps instead); an int4 group's scale as it is.
inline float folded(const uint8_t*) { return 0x1p120f; }
inline float folded(const Int4*) { return 1.0f; }
inline float folded(const Int4Z*) { return 1.0f; }
inline float folded(const Int8Z*) { return 1.0f; }
inline bool too_big(const uint8_t*, float s) { return !(std::fabs(s) < 256.0f); }
inline bool too_big(const Int4*, float) { return false; }
inline bool too_big(const Int4Z*, float) { return false; }
inline bool too_big(const Int8Z*, float) { return false; }

// Float32 subnormal inputs taken as they are (not as zero) while it lives, on this thread:
// XLA's threads may run with denormals-are-zero set. (Results still flush as the thread
// says: a dequantized weight below 2^-126 would, where numpy's dequantization keeps it.)
struct KeepSubnormals {
#if defined(__SSE__)
  unsigned saved = _mm_getcsr();
  KeepSubnormals() { _mm_setcsr(saved & ~0x0040u); }  // DAZ off
  ~KeepSubnormals() { _mm_setcsr(saved); }
#endif
};

// Pin a loaded vector in a register. Without it GCC folds the loads into the FMAs and repeats
// them for every pair of the tile (12 loads instead of 6 for 8 FMAs in a 2x4 tile).
inline void in_register(v8& v) {
#if defined(__x86_64__)
  asm("" : "+x"(v));
#endif
}

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

inline float hsum(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline v8 max8(v8 a, v8 b) { return a > b ? a : b; }

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

// e^x, 8 lanes: x = k ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts), e^r by a degree-6
// polynomial (relative error ~1e-7), times 2^k put together in the exponent bits. Below -87,
// where floats turn subnormal, the result is 0, as for -inf; above 88 it is e^88.
inline v8 exp8(v8 x) {
  typedef int32_t i8 __attribute__((vector_size(32)));
  const v8 lo = v8{} - 87.0f, hi = v8{} + 88.0f;
  const i8 keep = x >= lo;
  x = max8(x, lo);
  x = x < hi ? x : hi;
  v8 k = x * 1.44269504088896341f;
#if defined(__AVX__)
  k = reinterpret_cast<v8>(_mm256_round_ps(reinterpret_cast<__m256>(k),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int i = 0; i < 8; ++i) k[i] = std::nearbyint(k[i]);
#endif
  v8 r = fma8(k, v8{} - 0.693359375f, x);
  r = fma8(k, v8{} + 2.12194440e-4f, r);
  v8 q = v8{} + 1.9875691500e-4f;
  q = fma8(q, r, v8{} + 1.3981999507e-3f);
  q = fma8(q, r, v8{} + 8.3334519073e-3f);
  q = fma8(q, r, v8{} + 4.1665795894e-2f);
  q = fma8(q, r, v8{} + 1.6666665459e-1f);
  q = fma8(q, r, v8{} + 5.0000001201e-1f);
  const v8 y = fma8(q, r * r, r) + 1.0f;
  const i8 two_k = (__builtin_convertvector(k, i8) + 127) << 23;
  return reinterpret_cast<v8>(reinterpret_cast<i8>(y * reinterpret_cast<v8>(two_k)) & keep);
}

// silu(g) = g / (1 + e^-g), 8 lanes.
inline v8 silu8(v8 g) { return g / (1.0f + exp8(-g)); }

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
    // Compute-heavier tiles: keep the next weights coming, 2 KiB ahead in each row's stream.
    if constexpr (TR > 1) {
      if (c % (64 / sizeof(T)) == 0)  // once a cache line
        for (int i = 0; i < TW; ++i) __builtin_prefetch(w[i] + c + 2048 / sizeof(T), 0, 3);
    }
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

// One step of `scaled_block`: the same over rows widened and scaled as they are loaded.
template <bool Huge, int TR, typename Q, size_t... I>
__attribute__((always_inline)) inline void scaled_step(const Q* const* w, const float* const* x,
                                                       int64_t c, const v8* scale,
                                                       const v8* offset, v8 (*acc)[TR],
                                                       std::index_sequence<I...>) {
  multiply_add<TR>(acc, x, c, scaled8<Huge>(w[I], c, scale[I], offset[I])...);
}

// Columns [c0, c0 + blk) of `dots` over scaled rows (FP8 or int4): each weight widened and
// times scale[i], its row's block scale as scaled8 takes it (Huge: FP8 scales from 2^8 up).
template <int TW, int TR, bool Huge, typename Q>
inline void scaled_block(const Q* const* w, const float* const* x, int64_t c0, int64_t blk,
                         const v8* scale, const v8* offset, v8 (*acc)[TR]) {
  for (int64_t c = c0; c < c0 + blk; c += 8) {
    {
      // Once a cache line of values, 2 KiB ahead, as for the other weights, and here for a
      // single input too: one-row calls over FP8 and int8 rows are much slower without it
      // (float32 and bfloat16 rows, which stream fast alone, are slower with it).
      const int64_t at = value_bytes(w[0], c);
      if (at % 64 == 0)
        for (int i = 0; i < TW; ++i)
          __builtin_prefetch(reinterpret_cast<const char*>(w[i]) + at + 2048, 0, 3);
    }
    scaled_step<Huge>(w, x, c, scale, offset, acc, std::make_index_sequence<TW>{});
  }
}

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
      scaled_block<TW, TR, true>(w, x, c0, blk, scale, off, acc);
    } else {
      for (int i = 0; i < TW; ++i) scale[i] = scale[i] * folded(w[i]);
      scaled_block<TW, TR, false>(w, x, c0, blk, scale, off, acc);
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

// out[0 .. L) = one scaled row (its values, then L / blk scales) as float32: each value times
// its block's scale, exactly as `dots` widens it in registers.
template <typename Q>
inline void widen_row(const Q* w, int64_t L, int64_t blk, float* out) {
  const int64_t vb = value_bytes(w, L), nb = L / blk;
  for (int64_t c0 = 0; c0 < L; c0 += blk) {
    float s;
    std::memcpy(&s, reinterpret_cast<const char*>(w) + vb + 4 * (c0 / blk), sizeof s);
    const bool huge = too_big(w, s);
    const v8 scale = v8{} + (huge ? s : s * folded(w));
    v8 offset = scale;
    if constexpr (kOffsets<Q>) offset = v8{} + block_offset(w, vb, nb, c0 / blk);
    for (int64_t c = c0; c < c0 + blk; c += 8) {
      const v8 v = huge ? scaled8<true>(w, c, scale, offset) : scaled8<false>(w, c, scale, offset);
      std::memcpy(out + c, &v, sizeof v);
    }
  }
}

// Apply the rows w[0..R) of a [R, L] matrix (rows `ld` floats apart) to `r` inputs x[j]
// (length L): emit(row, j, value) for every row and input. The TW rows of a tile are a
// quarter (or a third) of the matrix apart, not neighbours: streams that far apart are
// prefetched in parallel, and short rows stream faster than from TW adjacent rows.
template <int TW, int TR, typename T, typename Emit>
inline void matvecs_tile(const T* W, int64_t R, int64_t L, int64_t ld, const float* const* x,
                         Emit emit, int64_t blk) {
  float out[TW * TR];
  const T* w[TW];
  const int64_t gap = R / TW;
  for (int64_t row = 0; row < gap; ++row) {
    for (int i = 0; i < TW; ++i) w[i] = W + (row + i * gap) * ld;
    dots<TW, TR>(w, x, L, out, blk);
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
  if (r == 4) return matvecs_tile<3, 4>(W, R, L, ld, x, emit, blk);
  if (r == 3) return matvecs_tile<3, 3>(W, R, L, ld, x, emit, blk);
  if (r == 2) return matvecs_tile<4, 2>(W, R, L, ld, x, emit, blk);
  if (r == 1) return matvecs_tile<4, 1>(W, R, L, ld, x, emit, blk);
  const int64_t gap = R / 3;  // rows a third of the matrix apart, as in matvecs_tile
  if constexpr (kScaled<T>) {
    // Scaled rows met by several tiles of inputs: each widened once, into float32 rows in L1,
    // which the float32 tiles then read (the same values, the same multiply-adds).
    thread_local std::vector<float> wide;
    wide.resize(3 * L);
    const float* w[3] = {wide.data(), wide.data() + L, wide.data() + 2 * L};
    int64_t rows[3];
    const int64_t row_bytes = ld * static_cast<int64_t>(sizeof(T));
    for (int64_t row = 0; row < gap; ++row) {
      for (int i = 0; i < 3; ++i) {
        rows[i] = row + i * gap;
        widen_row(W + rows[i] * ld, L, blk, wide.data() + i * L);
      }
      // The next three rows into L2 while the tiles compute on these: widen_row reads its
      // rows once, before any arithmetic, and would otherwise wait on DRAM for each of them.
      // (Float32 rows need no such step: their tiles prefetch as they go.)
      if (row + 1 < gap)
        for (int i = 0; i < 3; ++i) {
          const char* next = reinterpret_cast<const char*>(W + (rows[i] + 1) * ld);
          for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + b, 0, 2);
        }
      all_inputs<3>(w, rows, x, r, L, emit, 0);
    }
    for (int64_t row = gap * 3; row < R; ++row) {
      widen_row(W + row * ld, L, blk, wide.data());
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
  std::vector<const float*> hrow;  // and its hidden row in h
  float* h = nullptr;              // [assignments, F]: the hidden rows
  float* u = nullptr;              // [assignments, F]: up projections, before the product
  int64_t fchunk, dchunk;          // weight rows per work item in each phase
  int64_t fitems, ditems;          // work items per expert in each phase

  int64_t phase1() const { return static_cast<int64_t>(slot.size()) * fitems; }
  int64_t total() const { return static_cast<int64_t>(slot.size()) * (fitems + ditems); }

  // Phase 1, item (expert i, chunk c): h = silu(gate . x) * (up . x) over its share of F.
  void hidden(int64_t i, int64_t c) {
    const int64_t f0 = c * fchunk, nf = std::min(fchunk, F - f0), s = slot[i], q = first[i];
    const int64_t r = first[i + 1] - q;
    float* hq = h + q * F + f0;
    const T* G = gate + (s * F + f0) * ldg;
    const T* U = up + (s * F + f0) * ldg;
    float* uq = u + q * F + f0;
    matvecs(
        G, nf, D, &xrow[q], r, [&](int64_t f, int64_t j, float v) { hq[j * F + f] = v; }, ldg,
        bg);
    matvecs(
        U, nf, D, &xrow[q], r, [&](int64_t f, int64_t j, float v) { uq[j * F + f] = v; }, ldg,
        bg);
    for (int64_t j = 0; j < r; ++j) swiglu(hq + j * F, uq + j * F, nf);
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

  // Phase 2, item (expert i, chunk c): y = down . h over its share of D.
  void output(int64_t i, int64_t c) {
    const int64_t d0 = c * dchunk, nd = std::min(dchunk, D - d0), s = slot[i], q = first[i];
    const int64_t r = first[i + 1] - q;
    const int64_t* a = assign.data() + q;
    const T* Dn = down + (s * D + d0) * ldd;
    matvecs(
        Dn, nd, F, &hrow[q], r, [&](int64_t d, int64_t j, float v) { y[a[j] * D + d0 + d] = v; },
        ldd, bd);
  }
};

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
// weights (or KV) read, times the passes over them (one per tile of four inputs).
constexpr int64_t kSoloWork = 512 << 10;

// Run `gang` on the caller and up to items - 1 helpers from the pool (none below kSoloWork).
void run(ffi::ThreadPool& pool, const std::shared_ptr<Gang>& gang, int64_t items, int64_t work) {
  const int64_t most = work < kSoloWork ? 0 : std::max<int64_t>(pool.num_threads() - 1, 0);
  const int64_t helpers = std::min<int64_t>(most, items - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([gang] { gang->help(); });
  gang->finish();
}

// The expert call, in small items so that the threads finish together: every expert's
// phase-1 items, then every expert's phase-2 items (each once its expert's phase 1 is done;
// the ends below meet experts whose phase 1 they did themselves first). The items of a
// phase are in expert order, most rows first; the first thread to arrive takes them from the
// front, the second from the back (and so on, alternating), until the two ends meet. While
// one thread computes on the weights of experts many rows chose, the other streams those of
// experts few rows chose, so that arithmetic and memory traffic overlap.
template <typename T>
struct ExpertCall : Gang {
  Problem<T> p;
  std::atomic<int64_t> taken[2] = {0, 0};  // per phase: items taken from the front | back << 32
  std::unique_ptr<std::atomic<int64_t>[]> hidden_done;  // per expert: phase-1 items done
  std::atomic<int64_t> arrivals{0};

  void drain() override {
    [[maybe_unused]] std::conditional_t<kScaled<T>, KeepSubnormals, int> keep{};
    const bool back = arrivals.fetch_add(1, std::memory_order_relaxed) % 2 == 1;
    const int64_t n1 = p.phase1(), n2 = p.total() - n1;
    for (int64_t k; (k = take(taken[0], n1, back)) >= 0;) {
      p.hidden(k / p.fitems, k % p.fitems);
      hidden_done[k / p.fitems].fetch_add(1, std::memory_order_release);
    }
    // An expert's phase-2 items wait for its own hidden rows only, not for the other thread's
    // last phase-1 item.
    for (int64_t k; (k = take(taken[1], n2, back)) >= 0;) {
      const int64_t e = k / p.ditems;
      wait_until([&] { return hidden_done[e].load(std::memory_order_acquire) >= p.fitems; });
      p.output(e, k % p.ditems);
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

// At least n floats, not initialised, for the call this thread is making: the buffer is kept
// from call to call (it grows, never shrinks). A vector made per call was zeroed every time
// and, from a few MiB (the hidden rows of a prefill), mapped fresh from the kernel. It holds
// the hidden and up rows: 2 x rows x top-k x F floats (a 256-token prefill of top-8 experts
// with F = 2048: 32 MiB), on each thread that makes expert calls. No helper touches it once
// the call has returned (Gang::finish).
float* scratch(int64_t n) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local int64_t size = 0;
  if (n > size) {
    buf.reset(new float[n]);
    size = n;
  }
  return buf.get();
}

// Scaled rows (FP8 or int4, as `w` says) of L values held as `held` bytes (their values,
// then L / b float32 scales): the block width b, or 0 when they are not (b must be a multiple
// of 8 dividing L).
template <typename Q>
int64_t scale_width(const Q* w, int64_t L, int64_t held) {
  const int64_t extra = held - value_bytes(w, L), per = 4 * block_floats(w);
  if (L <= 0 || L % 8 || extra <= 0 || extra % per) return 0;
  const int64_t blocks = extra / per;
  if (L % blocks) return 0;
  const int64_t b = L / blocks;
  return b % 8 == 0 ? b : 0;
}

// Weight rows per work item: about `bytes` of weights, a multiple of 8 rows.
int64_t chunk_rows(int64_t row_bytes, int64_t rows, int64_t bytes) {
  const int64_t n = std::max<int64_t>(8, bytes / std::max<int64_t>(row_bytes, 1) / 8 * 8);
  return std::min(n, rows);
}

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
  const int64_t staged = p.first.back();
  p.h = scratch(2 * staged * F);
  p.u = p.h + staged * F;
  p.xrow.resize(staged);
  p.hrow.resize(staged);
  for (int64_t q = 0; q < staged; ++q) {
    p.xrow[q] = x.typed_data() + (p.assign[q] / K) * D;
    p.hrow[q] = p.h + q * F;
  }
  // Slices of 512 KiB (gate and up) and 256 KiB (down): halves of these were slower.
  const T* kind = nullptr;  // bytes of weights (their scales aside, for FP8 and int4):
  p.fchunk = chunk_rows(2 * value_bytes(kind, D), F, 512 << 10);
  p.dchunk = chunk_rows(value_bytes(kind, F), D, 256 << 10);
  p.fitems = (F + p.fchunk - 1) / p.fchunk;
  p.ditems = (D + p.dchunk - 1) / p.dchunk;

  const int64_t experts = static_cast<int64_t>(p.slot.size());
  call->hidden_done.reset(new std::atomic<int64_t>[experts]());
  const int64_t passes = experts ? (staged / experts + 3) / 4 : 1;  // tiles of 4 rows each
  run(pool, call, p.total(), experts * 3 * F * value_bytes(kind, D) * passes);
  return ffi::Error::Success();
}

// y [M, O] = x [M, I] . w [O, I]^T, in slices of ~128 KiB of w shared out among the threads;
// each output is one dot product computed as in the expert kernel (batch-invariant bitwise).
// w is float32, bfloat16 bits (T = uint16_t), FP8 rows (T = uint8_t: each row's I values,
// then its I / blk float32 block scales, ld bytes in all), int4 rows (T = Int4: I / 2 bytes
// of values, then I / blk scales) or int4 (Int4Z) or int8 (Int8Z) rows with offsets, widened
// as it is loaded.
template <typename T>
struct LinearCall : Gang {
  const T* w;
  float* y;
  int64_t M, O, I, ld, blk, chunk, items;
  std::vector<const float*> xrow;
  std::atomic<int64_t> next{0};

  void drain() override {
    [[maybe_unused]] std::conditional_t<kScaled<T>, KeepSubnormals, int> keep{};
    for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t o0 = k * chunk, no = std::min(chunk, O - o0);
      matvecs(
          w + o0 * ld, no, I, xrow.data(), M,
          [&](int64_t o, int64_t m, float v) { y[m * O + o0 + o] = v; }, ld, blk);
    }
  }
};

template <ffi::DataType WT, typename T>
ffi::Error Linear(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("colibri_linear: wrong ranks");
  const int64_t unit = sizeof(*w.typed_data()) / sizeof(T);  // T a buffer element (Int4Z: 4)
  const int64_t M = xd[0], I = xd[1], O = wd[0], ld = wd[1] * unit;
  if (yd[0] != M || yd[1] != O)
    return ffi::Error::InvalidArgument("colibri_linear: shapes disagree");
  int64_t blk = 0;
  const T* kind = nullptr;
  if constexpr (kScaled<T>) {
    blk = scale_width(kind, I, ld);
    if (blk == 0)
      return ffi::Error::InvalidArgument(
          "colibri_linear_fp8/int4/int8: rows are not I values and I / b scales (and "
          "offsets), b of 8");
  } else if (ld != I) {
    return ffi::Error::InvalidArgument("colibri_linear: shapes disagree");
  }
  auto call = std::make_shared<LinearCall<T>>();
  call->w = reinterpret_cast<const T*>(w.typed_data());
  call->y = y->typed_data();
  call->M = M;
  call->O = O;
  call->I = I;
  call->ld = ld;
  call->blk = blk;
  call->chunk = chunk_rows(value_bytes(kind, I), O, 128 << 10);
  call->items = O ? (O + call->chunk - 1) / call->chunk : 0;
  call->xrow.resize(M);
  for (int64_t m = 0; m < M; ++m) call->xrow[m] = x.typed_data() + m * I;
  run(pool, call, call->items, O * value_bytes(kind, I) * ((M + 3) / 4));
  return ffi::Error::Success();
}

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

  void drain() override {
    const int64_t G = H / Hkv, items = B * Hkv;
    std::vector<float> p;
    std::vector<const float*> qs(G);
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t b = item / Hkv, g = item % Hkv, s = slot[b];
      float* o = out + (b * H + g * G) * Dh;
      std::fill(o, o + G * Dh, 0.0f);
      if (s < 0 || s >= S || pos[b] < 0) continue;
      const int64_t n = std::min<int64_t>(pos[b], C - 1) + 1;
      for (int64_t j = 0; j < G; ++j) qs[j] = q + (b * H + g * G + j) * Dh;
      const int64_t ld = Dh;  // floats from one position's key to the next
      const float* kb = k + (s * Hkv + g) * C * Dh;
      const float* vb = v + (s * Hkv + g) * C * Dh;
      const int64_t np = (n + 7) / 8 * 8;  // score rows padded to whole vectors
      p.resize(G * np);
      matvecs(kb, n, Dh, qs.data(), G, [&](int64_t t, int64_t j, float d) { p[j * np + t] = d; },
              ld);
      for (int64_t j = 0; j < G; ++j) softmax(p.data() + j * np, n, np, scale);
      // o[j] = sum over t of p[j, t] * v[t], in order of t: per head, Dh floats at a time in
      // registers (the value rows are re-read from cache for each head of the group).
      for (int64_t j = 0; j < G; ++j) {
        const float* pj = p.data() + j * np;
        float* oj = o + j * Dh;
        int64_t d0 = 0;
        for (; d0 + 64 <= Dh; d0 += 64) accumulate<8>(pj, vb + d0, ld, n, oj + d0);
        for (; d0 + 8 <= Dh; d0 += 8) accumulate<1>(pj, vb + d0, ld, n, oj + d0);
        for (; d0 < Dh; ++d0) {
          float acc = 0.0f;
          for (int64_t t = 0; t < n; ++t) acc = std::fma(pj[t], vb[t * ld + d0], acc);
          oj[d0] = acc;
        }
      }
    }
  }

  // out[0 .. 8 * NV) = sum over t < n of p[t] * v[t * ld + ...], one FMA chain per lane.
  // Not inlined: inside drain() GCC keeps acc in memory and stores all NV sums at every
  // position.
  template <int NV>
  __attribute__((noinline)) static void accumulate(const float* p, const float* v, int64_t ld,
                                                    int64_t n, float* out) {
    v8 acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = v8{};
    for (int64_t t = 0; t < n; ++t) {
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

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                  ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> slots,
                  ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto sd = slots.dimensions(), pd = pos.dimensions(), od = out->dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || sd.size() != 1 || pd.size() != 1 ||
      od.size() != 3)
    return ffi::Error::InvalidArgument("colibri_attend: wrong ranks");
  const int64_t B = qd[0], H = qd[1], Dh = qd[2], S = kd[0], Hkv = kd[1], C = kd[2];
  if (kd[3] != Dh || vd[0] != S || vd[1] != Hkv || vd[2] != C || vd[3] != Dh || sd[0] != B ||
      pd[0] != B || od[0] != B || od[1] != H || od[2] != Dh || Hkv == 0 || H % Hkv != 0)
    return ffi::Error::InvalidArgument("colibri_attend: shapes disagree");
  auto call = std::make_shared<AttendCall>();
  call->q = q.typed_data();
  call->k = k.typed_data();
  call->v = v.typed_data();
  call->slot = slots.typed_data();
  call->pos = pos.typed_data();
  call->out = out->typed_data();
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
  run(pool, call, B * Hkv, bytes);
  return ffi::Error::Success();
}

// Raised by the host (a frame came in) so that a long burst of decode steps ends after the step
// it is in; lowered when the host has taken what came in. Process-wide: a burst cut short is
// still exact, only shorter.
std::atomic<int32_t> cut_flag{0};

// step [] int32 (the loop's counter: the call is made per step and never hoisted) -> [] int32.
ffi::Error CutRequested(ffi::Buffer<ffi::S32> step, ffi::ResultBuffer<ffi::S32> out) {
  (void)step;
  *out->typed_data() = cut_flag.load(std::memory_order_acquire);
  return ffi::Error::Success();
}

}  // namespace

extern "C" void colibri_request_cut(int32_t on) {
  cut_flag.store(on, std::memory_order_release);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriCutRequested, CutRequested,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriAttend, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinear, (Linear<ffi::F32, float>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinearBf16, (Linear<ffi::U16, uint16_t>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinearFp8, (Linear<ffi::U8, uint8_t>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinearInt4, (Linear<ffi::S8, Int4>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinearInt4z, (Linear<ffi::U32, Int4Z>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinearInt8, (Linear<ffi::S32, Int8Z>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMoeExperts, (MoeExperts<ffi::F32, float>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The same over bfloat16 weights held as uint16 bit patterns (XLA CPU rewrites a whole bf16
// buffer on every in-place update; uint16 ones it updates in place).
XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMoeExpertsBf16, (MoeExperts<ffi::U16, uint16_t>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The same over FP8 rows (uint8: each row's float8_e4m3fn values, then its float32 block
// scales): a block-quantized checkpoint's experts at a quarter of the bytes of float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMoeExpertsFp8, (MoeExperts<ffi::U8, uint8_t>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The same over int4 rows (int8 buffers of bytes: each row's four-bit values, two a byte,
// then its float32 group scales): a pack-quantized checkpoint's experts at an eighth of the
// bytes of float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMoeExpertsInt4, (MoeExperts<ffi::S8, Int4>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The same over int4 rows with zero points (uint32 buffers: each row's four-bit values, eight
// a word, then its float32 group scales and offsets): GPTQ's and AWQ's asymmetric experts at
// about an eighth of the bytes of float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMoeExpertsInt4z, (MoeExperts<ffi::U32, Int4Z>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The same over int8 rows (int32 buffers: each row's values one a byte, then its float32
// group scales and offsets): 8-bit pack-quantized and GPTQ experts at about a quarter of the
// bytes of float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMoeExpertsInt8, (MoeExperts<ffi::S32, Int8Z>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
