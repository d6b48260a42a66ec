// The held formats: how each one's weights sit in memory and are widened to float32 as they are
// loaded, and the list (COLIBRI_HELD_FORMATS) from which cpu.cc defines the kernels of each.
//
// Held as gate, up [S, F, D] and down [S, D, F] for colibri_moe_experts (cpu/experts.h), as
// w [O, I] for colibri_linear (cpu/linear.h); L below is a row's length (D, F or I):
// float32 (no suffix): the weights as they are.
// _bf16: bfloat16 bit patterns (uint16), widened exactly to float32 as they are loaded (half
// the bytes read, the same results).
// _bf16p: the same bits (int16), times inputs rounded to bfloat16, summed in float32
// (bfloat16 products, cpu/bf16p.h): other results than float32's, on purpose.
// _fp8: FP8 rows (uint8): each row of a matrix is its L float8_e4m3fn values, then its L / b
// float32 block scales (one per b columns; b a multiple of 8 dividing L), so gate and up are
// [S, F, D + 4 D / b] and down [S, D, F + 4 F / b], w [O, I + 4 I / b]. A weight is widened and
// times its block's scale (rounded once) as it is loaded: the float32 a block-quantized
// checkpoint dequantizes to, at a quarter of the bytes.
// _int4: int4 rows (int8 buffers of bytes): each row's L four-bit values packed two a byte (the
// first in the low nibble, each offset by 8), then its L / g float32 group scales (g a multiple
// of 8 dividing L), so gate and up are [S, F, D / 2 + 4 D / g], w [O, I / 2 + 4 I / g]; a
// weight is its integer times its group's scale (rounded once): the float32 a pack-quantized
// checkpoint dequantizes to, at an eighth of the bytes.
// _int4z: int4 rows with zero points (uint32 buffers, whole words a row): each row's L four-bit
// values as above, then its L / g float32 group scales s, then as many offsets -z s (z the
// group's zero point, the product exact), w [O, I / 8 + 2 I / g] words: a weight is
// fma(q, s, -z s), (q - z) s rounded once, the float32 GPTQ's and AWQ's asymmetric weights
// dequantize to.
// _int8: int8 rows (int32 buffers, whole words a row): each row's L values as stored, unsigned
// bytes, then its L / g float32 group scales s, then as many offsets -z s (z the zero point,
// 128 when symmetric), w [O, I / 4 + 2 I / g] words: a weight is fma(q, s, -z s), as for
// int4z: 8-bit pack-quantized and GPTQ weights at about a quarter of the bytes of float32.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "simd.h"

// X(Name, suffix, buffer, T) for each held format, in the order of colibri/formats.py's
// FORMATS (tests/test_kernels.py checks that the two agree): Name ends its handlers' symbols
// (ColibriMoeExperts##Name, ColibriLinear##Name), suffix (that format's HeldFormat.suffix) the
// targets the Python side registers them as (colibri_moe_experts##suffix), buffer is the
// ffi::DataType of the arrays that hold the weights and T the element type the kernels read
// them as (float, uint16_t: bfloat16 bits, Bf16P, uint8_t: FP8 rows, Int4, Int4Z, Int8Z below).
// Bfloat16 weights come as uint16 bit patterns: XLA CPU rewrites a whole bf16 buffer on every
// in-place update, uint16 ones it updates in place. A new format is one line here (with its
// loading below and its HeldFormat in colibri/formats.py).
#define COLIBRI_HELD_FORMATS(X)   \
  X(, , F32, float)               \
  X(Bf16, _bf16, U16, uint16_t)   \
  X(Bf16p, _bf16p, S16, Bf16P)    \
  X(Fp8, _fp8, U8, uint8_t)       \
  X(Int4, _int4, S8, Int4)        \
  X(Int4z, _int4z, U32, Int4Z)    \
  X(Int8, _int8, S32, Int8Z)

namespace {

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

// A bfloat16 weight whose products take their inputs rounded to bfloat16 (cpu/bf16p.h).
struct Bf16P {
  uint16_t bits;
};

// Weights multiplied in bfloat16 (bf16p.h's kernels) rather than widened to float32.
template <typename T>
constexpr bool kProducts = std::is_same_v<T, Bf16P>;

// A byte of int4 rows (two four-bit values, each offset by 8). In rows of whole groups of 64
// columns whose blocks are a multiple of 32 (`lane_major`) each 64 columns are 32 bytes held
// lane by lane: byte 4 l + k holds column 8 k + l in its low nibble and column 8 (k + 4) + l
// in its high one (l < 8, k < 4), so that one 32-byte load gives eight steps of eight lanes, a
// step's nibbles a shift away in every 32-bit lane (a block of 32 columns: the low or the
// high nibbles of its group's bytes). Other rows hold their columns in order, the first of
// two in the low nibble. (colibri/formats.py packs and unpacks them so.)
struct Int4 {
  uint8_t byte;
};

constexpr int64_t kLaneGroup = 64;  // columns a lane-major group of int4 values holds

// Int4 values in column order (two a byte, the first in the low nibble) laid out lane by lane,
// `groups` groups of 64 columns (32 bytes) from `in` to `out`: byte 4 k + m and byte
// 4 k + m + 16 hold columns 8 k + 2 m, + 1 and 8 (k + 4) + 2 m, + 1, whose low nibbles make
// output byte 8 m + k (lane 2 m, steps k and k + 4) and high nibbles byte 8 m + 4 + k (lane
// 2 m + 1). colibri/formats.py packs int4 rows with it (numpy's own steps took ~20x longer).
inline void int4_lanes(const uint8_t* in, uint8_t* out, int64_t groups) {
#if defined(__SSSE3__)
  const __m128i low = _mm_set1_epi8(0x0f), high = _mm_set1_epi8(static_cast<char>(0xf0));
  const __m128i by_lane = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t g = 0; g < groups; ++g, in += 32, out += 32) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 16));
    // Byte 4 k + m: lane 2 m's steps k and k + 4 (even), lane 2 m + 1's (odd); then each
    // lane's four bytes together, and the lanes in order.
    const __m128i even = _mm_shuffle_epi8(
        _mm_or_si128(_mm_and_si128(a, low), _mm_and_si128(_mm_slli_epi16(b, 4), high)), by_lane);
    const __m128i odd = _mm_shuffle_epi8(
        _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), low), _mm_and_si128(b, high)), by_lane);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi32(even, odd));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_unpackhi_epi32(even, odd));
  }
#else
  for (int64_t g = 0; g < groups; ++g, in += 32, out += 32)
    for (int m = 0; m < 4; ++m)
      for (int k = 0; k < 4; ++k) {
        const uint8_t a = in[4 * k + m], b = in[4 * k + m + 16];
        out[8 * m + k] = static_cast<uint8_t>((a & 15) | (b << 4));
        out[8 * m + 4 + k] = static_cast<uint8_t>((a >> 4) | (b & 0xf0));
      }
#endif
}

// Whether int4 rows of L columns in scale blocks of blk hold their values lane-major.
constexpr bool lane_major(int64_t blk, int64_t L) {
  return blk % (kLaneGroup / 2) == 0 && L % kLaneGroup == 0;
}

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

// The bit of its 32-bit lane at which the value of column c (a multiple of 8) of an int4 row
// held lane-major starts, in its group's 32 bytes: 8 (k % 4) + 4 (k / 4) for the group's step
// k.
constexpr int lane_shift(int64_t c) {
  const int k = static_cast<int>((c & (kLaneGroup - 1)) / 8);
  return 8 * (k % 4) + 4 * (k / 4);
}

// Column c's group of 64: loops over lane-major rows step through `group_of(c) + 8 s`, whose
// shifts the compiler then knows (a shift by an immediate, not one by a register loaded from
// a general one: an operation more on the port of the permutes).
constexpr int64_t group_of(int64_t c) { return c & ~(kLaneGroup - 1); }

// Columns [c0, c0 + n) of a lane-major row, a block of n columns (multiples of 32): a group at
// a time where they are whole groups, else by halves where the block begins or ends inside a
// group (Kimi's blocks of 32): piece(g, first, steps) for the group from column g, its steps
// first .. first + steps (std::integral_constants: 0 and 8, 0 and 4, or 4 and 4), so that
// loops over a piece's steps know their shifts. (With the halves in a loop of their own, a
// test for each half, one-row expert calls over blocks of 32 took 1.07x the time.)
template <typename Piece>
__attribute__((always_inline)) inline void lane_pieces(int64_t c0, int64_t n, Piece piece) {
  using Zero = std::integral_constant<int, 0>;
  using Four = std::integral_constant<int, 4>;
  if (n % kLaneGroup == 0) {
    for (int64_t c = c0; c < c0 + n; c += kLaneGroup)
      piece(group_of(c), Zero{}, std::integral_constant<int, 8>{});
    return;
  }
  for (int64_t c = c0; c < c0 + n;) {
    const int64_t g = group_of(c);
    if (c != g) {
      piece(g, Four{}, Four{});
      c += kLaneGroup / 2;
    } else if (c + kLaneGroup <= c0 + n) {
      piece(g, Zero{}, std::integral_constant<int, 8>{});
      c += kLaneGroup;
    } else {
      piece(g, Zero{}, Four{});
      c += kLaneGroup / 2;
    }
  }
}

#if defined(__AVX2__)
// The values of columns c .. c + 8 of an int4 row (c a multiple of 8) in the low four bits of
// their 32-bit lanes (the bits above them: other values). Lane-major: the group's 32 bytes
// shifted by the step's lane_shift; in order: the step's four bytes in every lane, each
// shifted to its own.
template <bool Lanes>
inline __m256i nibble_lanes(const void* w, int64_t c) {
  const uint8_t* b = static_cast<const uint8_t*>(w);
  if constexpr (Lanes) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + group_of(c) / 2));
    return _mm256_srl_epi32(v, _mm_cvtsi32_si128(lane_shift(c)));
  } else {
    uint32_t word;
    std::memcpy(&word, b + c / 2, sizeof word);
    return _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)),
                             _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  }
}
#endif

// The eight values of an int4 row from column c (0 to 15, the stored values before their
// offset), exactly, as float32: each lane shifted to its nibble and masked.
template <bool Lanes>
inline v8 nibbles8(const void* w, int64_t c) {
#if defined(__AVX2__)
  const __m256i nib = _mm256_and_si256(nibble_lanes<Lanes>(w, c), _mm256_set1_epi32(15));
  return reinterpret_cast<v8>(_mm256_cvtepi32_ps(nib));
#else
  const uint8_t* b = static_cast<const uint8_t*>(w);
  const int64_t k = (c - group_of(c)) / 8;  // lane-major: the group's step
  v8 v;
  for (int i = 0; i < 8; ++i) {
    const int64_t at = Lanes ? group_of(c) / 2 + 4 * i + k % 4 : (c + i) / 2;
    const int shift = Lanes ? 4 * static_cast<int>(k / 4) : 4 * static_cast<int>((c + i) % 2);
    v[i] = static_cast<float>((b[at] >> shift) & 15);
  }
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
// and for FP8 the 2^120 its widening leaves out, folded into the scale unless Huge). Lanes:
// int4 values held lane-major (the others ignore it).
template <bool Huge, bool Lanes = false>
inline v8 scaled8(const uint8_t* w, int64_t c, v8 scale, v8) {
  return Huge ? (e4m3x8(w + c) * 0x1p120f) * scale : e4m3x8(w + c) * scale;
}

// An int4 weight is (q - z) s rounded once; as q s - z s in one fused multiply-add (z s
// exact: 8 s, or for Int4Z the stored offset, checked exact when the rows are made) it is
// that same rounding of the same exact value, one instruction fewer. (The int4 offset is
// made here from the scale: an offset vector of its own was slower.)
template <bool Huge, bool Lanes = false>
inline v8 scaled8(const Int4* w, int64_t c, v8 scale, v8) {
  return fma8(nibbles8<Lanes>(w, c), scale, scale * -8.0f);
}
template <bool Huge, bool Lanes = false>
inline v8 scaled8(const Int4Z* w, int64_t c, v8 scale, v8 offset) {
  return fma8(nibbles8<Lanes>(w, c), scale, offset);
}
template <bool Huge, bool Lanes = false>
inline v8 scaled8(const Int8Z* w, int64_t c, v8 scale, v8 offset) {
  return fma8(bytes8(w + c), scale, offset);
}

template <typename T>
constexpr bool kNibbles = std::is_same_v<T, Int4> || std::is_same_v<T, Int4Z>;

#if defined(__AVX512F__) && defined(__AVX512VL__)
// Int4 weights looked up rather than made (AVX-512 builds, their 256-bit forms included): a
// block's sixteen weights, one for each four-bit value q, made once as scaled8 makes them
// (fma(q, s, offset), the offset -8 s for Int4, stored for Int4Z), and each step's weights
// looked up by their nibbles with a shift and a two-table permute (which reads an index's low
// four bits only) instead of a shift, a mask, a conversion and a multiply-add. Bitwise
// scaled8's weights. tiles.h's row_pair_dots looks up two rows' sixteen in one 512-bit permute.
// block_table: the table of block k of int4 row w (its L / blk = nb scales after its vb value
// bytes, then Int4Z's offsets) in one operation, the scale and offset broadcast from memory (a
// load each, where a broadcast from a register takes a shuffle); Int4's as (q - 8) s, one
// rounding of the exact product, as fma(q, s, -8 s) is of the same exact value.
template <typename Q>
inline __m512 block_table(const Q* w, int64_t vb, int64_t nb, int64_t k) {
  static_assert(kNibbles<Q>);
  const float* at = reinterpret_cast<const float*>(reinterpret_cast<const char*>(w) + vb);
  const auto held = [](const float* f) {
    return reinterpret_cast<v16>(_mm512_broadcastss_ps(_mm_load_ss(f)));
  };
  const v16 q = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  if constexpr (kOffsets<Q>)
    return reinterpret_cast<__m512>(fma16(q, held(at + k), held(at + nb + k)));
  else
    return reinterpret_cast<__m512>((q - 8.0f) * held(at + k));
}

// The eight weights of an int4 row from column c, looked up in their block's table, given as
// its halves (lo, hi: tiles keep them split for the block's steps), or whole.
template <bool Lanes>
inline v8 looked_up8(const void* w, int64_t c, __m256 lo, __m256 hi) {
  return reinterpret_cast<v8>(_mm256_permutex2var_ps(lo, nibble_lanes<Lanes>(w, c), hi));
}
inline __m256 upper_half(__m512 table) {
  return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(table), 1));
}
template <bool Lanes>
inline v8 looked_up8(const void* w, int64_t c, __m512 table) {
  return looked_up8<Lanes>(w, c, _mm512_castps512_ps256(table), upper_half(table));
}

// Sixteen weights of a row from column c (two steps), as looked_up8 and scaled8 make eight
// (the same operations on every lane: the same bits), where widen_row writes a row out whole.
template <bool Lanes>
inline v16 looked_up16(const void* w, int64_t c, __m512 table) {
  const uint8_t* b = static_cast<const uint8_t*>(w);
  __m512i q;
  if constexpr (Lanes) {  // both steps from the group's 32 bytes, each half shifted to its own
    const __m512i v = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + group_of(c) / 2)));
    q = _mm512_srlv_epi32(
        v, _mm512_mask_set1_epi32(_mm512_set1_epi32(lane_shift(c)), 0xff00, lane_shift(c + 8)));
  } else {
    uint32_t lo, hi;
    std::memcpy(&lo, b + c / 2, sizeof lo);
    std::memcpy(&hi, b + c / 2 + 4, sizeof hi);
    const __m512i shift =
        _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    q = _mm512_srlv_epi32(_mm512_mask_set1_epi32(_mm512_set1_epi32(static_cast<int>(lo)), 0xff00,
                                                 static_cast<int>(hi)),
                          shift);
  }
  return reinterpret_cast<v16>(_mm512_permutexvar_ps(q, table));
}

template <bool Huge>
inline v16 scaled16(const uint8_t* w, int64_t c, v16 scale, v16) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c));
  const __m512i placed = _mm512_and_si512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(b), 20),
                                          _mm512_set1_epi32(static_cast<int32_t>(0x87f00000u)));
  const v16 e = reinterpret_cast<v16>(_mm512_castsi512_ps(placed));
  return Huge ? (e * 0x1p120f) * scale : e * scale;
}
template <bool Huge>
inline v16 scaled16(const Int8Z* w, int64_t c, v16 scale, v16 offset) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c));
  return fma16(reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))), scale, offset);
}
#endif

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

}  // namespace
