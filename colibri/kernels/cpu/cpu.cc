// CPU kernels for decode, called from XLA through the typed FFI: the routed experts of a
// layer, a plain linear layer for a few rows, and attention of one new token per row. This
// one translation unit (what colibri/kernels/__init__.py compiles) includes them and defines
// their handlers, those of the experts and linears once per held format:
//
//   simd.h     eight-lane float32 vectors: loads, multiply-adds, horizontal sums, e^x, silu
//   formats.h  the held formats (COLIBRI_HELD_FORMATS) and how their weights are widened
//   bf16p.h    bfloat16 products: inputs rounded to bfloat16, VDPBF16PS or its emulation
//   tiles.h    the dot-product tiles and `matvecs`, a matrix's rows against a few inputs;
//              in AVX-512 builds int4, int8 and FP8 rows two a 512-bit vector
//   pairs.h    AVX-512 builds: tiles of two inputs a 512-bit vector, over inputs packed once
//   gang.h     a call's work shared out among XLA's intra-op threads (and, in traced
//              builds, colibri_take_traced_calls: when each call's threads ran)
//   experts.h  colibri_moe_experts (one target per held format)
//   linear.h   colibri_linear (one target per held format)
//   heads.h    colibri_linear_heads, colibri_linear_heads_t (one target per held format)
//   attend.h   colibri_attend, colibri_attend_write, colibri_mla_attend
//   cut.h      colibri_cut_requested
//   norm.h     colibri_rms_norm
//   route.h    colibri_route_softmax: a softmax router's top k and their weights
//   greedy.h   colibri_greedy: each row's argmax, the greedy token
//   peak.h     colibri_fma_peak, colibri_bf16_dot_peak and colibri_read_sum: the ceilings
//              and the read rate the kernels are measured against
//
// Exactness: every dot product is one 8-lane accumulator advanced over the vector in order,
// a fixed horizontal sum and then the scalar tail, whatever tile it is computed in, and the
// element-wise exp (softmax, SwiGLU) is one routine, the same operations on every lane, eight
// or sixteen at a time.
// A row's output therefore depends only on its input and the expert's weights, never on how
// many other rows chose the same expert or which slot holds it: batched, chunked and staged
// results are bitwise those of the row alone. Nor on the CPU: the 8 lanes are the order of the
// sums, not the width of the machine's vectors, so a build for AVX2 and one for AVX-512 (32
// registers, EVEX encodings) give the same bits (kernels.ISA_LEVELS; tests/test_kernels.py).
// Bfloat16 products keep an order of their own, 16 lanes over pairs of columns (bf16p.h),
// the instruction's where the build has it and emulated where it has not: the same bits too.
//
// The design, and the measurements behind the choices below: docs/kernels.md.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attend.h"
#include "cut.h"
#include "experts.h"
#include "formats.h"
#include "greedy.h"
#include "heads.h"
#include "linear.h"
#include "norm.h"
#include "peak.h"
#include "route.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" void colibri_request_cut(int32_t on) {
  cut_flag.store(on, std::memory_order_release);
}

// Int4 rows' values laid out lane by lane (formats.h), for colibri/formats.py's packing.
extern "C" void colibri_int4_lanes(const uint8_t* in, uint8_t* out, int64_t groups) {
  int4_lanes(in, out, groups);
}

// Traced builds (gang.h's COLIBRI_TRACE_CALLS): the calls timed since the last take.
extern "C" int64_t colibri_take_traced_calls(int64_t* out, int64_t n) {
  return take_traced(out, n);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriCutRequested, CutRequested,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// What both attention targets take first: q, k, v, slots, pos.
static auto AttendOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriAttend, Attend,
                              AttendOperands().Ret<ffi::Buffer<ffi::F32>>().Attr<float>("scale"));

// ColibriAttendWrite: also the new keys and values; the output, then the caches.
XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriAttendWrite, AttendWrite,
                              AttendOperands()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMlaAttend, MlaAttend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriGreedy, Greedy,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriRouteSoftmax, RouteSoftmax,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("norm"));

// What the linear and per-head handlers take: x float32, w held as the format says (WT), the
// result float32.
template <ffi::DataType WT>
static auto HeldOperands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::Buffer<WT>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

// ColibriLinear##Name: x float32, w held as the format says.
#define COLIBRI_LINEAR_HANDLER(Name, suffix, WT, T)                       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinear##Name, (Linear<ffi::WT, T>), \
                                HeldOperands<ffi::WT>());

// ColibriMoeExperts##Name: gate, up and down held as the format says, x float32, ids int32.
#define COLIBRI_EXPERTS_HANDLER(Name, suffix, WT, T)                                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriMoeExperts##Name, (MoeExperts<ffi::WT, T>), \
                                ffi::Ffi::Bind()                                   \
                                    .Ctx<ffi::ThreadPool>()                        \
                                    .Arg<ffi::Buffer<ffi::WT>>()                   \
                                    .Arg<ffi::Buffer<ffi::WT>>()                   \
                                    .Arg<ffi::Buffer<ffi::WT>>()                   \
                                    .Arg<ffi::Buffer<ffi::F32>>()                  \
                                    .Arg<ffi::Buffer<ffi::S32>>()                  \
                                    .Ret<ffi::Buffer<ffi::F32>>());

// ColibriLinearHeads##Name, ColibriLinearHeadsT##Name: x float32, w held as the format says
// (bfloat16 products refused).
#define COLIBRI_HEADS_HANDLERS(Name, suffix, WT, T)                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinearHeads##Name, (LinearHeads<ffi::WT, T>),   \
                                HeldOperands<ffi::WT>().Attr<int64_t>("first"));       \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(ColibriLinearHeadsT##Name, (LinearHeadsT<ffi::WT, T>), \
                                HeldOperands<ffi::WT>().Attr<int64_t>("first"));

COLIBRI_HELD_FORMATS(COLIBRI_LINEAR_HANDLER)
COLIBRI_HELD_FORMATS(COLIBRI_HEADS_HANDLERS)
COLIBRI_HELD_FORMATS(COLIBRI_EXPERTS_HANDLER)

// colibri_widen_peak##suffix: one core putting rows held as the format says through the tiles
// of one-row calls, the rows in its caches: R rows of L weights (row_bytes each, as the linear
// kernel takes them) met by one input over and over for about `seconds`, on the calling
// thread. GB/s of rows as held: what the widening and the multiply-adds allow a one-row call
// where memory keeps up, the call's own costs aside (colibri/bench/bandwidth.py's widen_rate);
// 0 for rows that are not the format's.
template <typename T>
static double widen_peak(const void* w, int64_t R, int64_t L, int64_t row_bytes,
                         double seconds) {
  const T* W = static_cast<const T*>(w);
  const int64_t ld = row_bytes / static_cast<int64_t>(sizeof(T));
  int64_t blk = 0;
  if constexpr (kScaled<T>) {
    blk = scale_width(W, L, ld);
    if (blk == 0) return 0;
  } else if (ld != L || row_bytes % sizeof(T)) {
    return 0;
  }
  if (R <= 0) return 0;
  [[maybe_unused]] std::conditional_t<
      kScaled<T>, KeepSubnormals, std::conditional_t<kProducts<T>, FlushSubnormals, int>>
      keep{};
  std::vector<float> xv(L), y(R);
  for (int64_t i = 0; i < L; ++i) xv[i] = 1.0f / static_cast<float>(1 + i % 13);
  std::vector<uint16_t> xb(kProducts<T> ? L : 0);
  if constexpr (kProducts<T>) round_row(xv.data(), L, xb.data());
  const float* x[1] = {xv.data()};
  const uint16_t* xh[1] = {xb.data()};
  float* out = y.data();
  const auto emit = [out](int64_t o, int64_t, float v) { out[o] = v; };
  const auto start = std::chrono::steady_clock::now();
  int64_t passes = 0;
  double spent = 0;
  do {
    if constexpr (kProducts<T>)
      bmatvecs(W, R, L, ld, xh, 1, emit);
    else
      matvecs(W, R, L, x, 1, emit, ld, blk);
    asm volatile("" : : "r"(out) : "memory");  // every pass computed and its results kept
    ++passes;
    spent = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (spent < seconds);
  return static_cast<double>(passes) * R * row_bytes / spent / 1e9;
}

#define COLIBRI_WIDEN_PEAK(Name, suffix, WT, T)                                            \
  extern "C" double colibri_widen_peak##suffix(const void* w, int64_t R, int64_t L,        \
                                               int64_t row_bytes, double seconds) {        \
    return widen_peak<T>(w, R, L, row_bytes, seconds);                                     \
  }

COLIBRI_HELD_FORMATS(COLIBRI_WIDEN_PEAK)

#undef COLIBRI_LINEAR_HANDLER
#undef COLIBRI_HEADS_HANDLERS
#undef COLIBRI_EXPERTS_HANDLER
#undef COLIBRI_WIDEN_PEAK
