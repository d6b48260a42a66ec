// colibri_linear: y [M, O] = x [M, I] . w [O, I]^T for a few rows; colibri_linear_bf16, _fp8,
// _int4, _int4z, _int8: w held in those formats (formats.h), as the experts' weights.

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "bf16p.h"
#include "formats.h"
#include "gang.h"
#include "pairs.h"
#include "tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// y [M, O] = x [M, I] . w [O, I]^T, in slices of w shared out among the threads (~256 KiB of
// float32 or bfloat16 rows, whose streams gain from running longer; ~128 KiB of scaled rows;
// longer ones for a single pass, see gang.h's kLongItems);
// each output is one dot product computed as in the expert kernel (batch-invariant bitwise).
// w is float32, bfloat16 bits (T = uint16_t), FP8 rows (T = uint8_t: each row's I values,
// then its I / blk float32 block scales, ld bytes in all), int4 rows (T = Int4: I / 2 bytes
// of values, then I / blk scales) or int4 (Int4Z) or int8 (Int8Z) rows with offsets, widened
// as it is loaded; or bfloat16 bits multiplied in bfloat16 (T = Bf16P: x rounded to
// bfloat16 first, once, into `xb`; bf16p.h).
template <typename T>
struct LinearCall : Gang {
  const T* w;
  float* y;
  int64_t M, O, I, ld, blk, chunk;
  int64_t least;  // takes of chunk rows, then shorter ones down to least rows (guided_rows)
  std::vector<const float*> xrow;
  std::vector<const uint16_t*> xb;  // Bf16P: x rounded to bfloat16, row by row
  Packed packed;  // the rows packed for the paired tiles, where they are used (packed.r > 0)
  std::atomic<int64_t> next{0};  // rows taken

  // The next rows to compute, [o0, o0 + n); false once every row is taken.
  bool take(int64_t& o0, int64_t& n) {
    int64_t s = next.load(std::memory_order_relaxed);
    do {
      if (s >= O) return false;
      n = guided_rows(O - s, threads, chunk, least);
    } while (!next.compare_exchange_weak(s, s + n, std::memory_order_relaxed));
    o0 = s;
    return true;
  }

  void drain() override {
    [[maybe_unused]] std::conditional_t<
        kScaled<T>, KeepSubnormals, std::conditional_t<kProducts<T>, FlushSubnormals, int>>
        keep{};
    for (int64_t o0, no; take(o0, no);) {
      auto apply = [&](auto emit) {
        if constexpr (kProducts<T>)
          bmatvecs(w + o0 * ld, no, I, ld, xb.data(), M, emit);
        else if (packed.r)
          matvecs(w + o0 * ld, no, I, packed, emit, ld, blk);
        else
          matvecs(w + o0 * ld, no, I, xrow.data(), M, emit, ld, blk);
      };
      through_item_buffer(no, M, apply,
                          [&](int64_t o, int64_t m, float v) { y[m * O + o0 + o] = v; });
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
  // Items of up to kLongItems times that where the rows stream once (pairs.h's long_items),
  // while every thread still gets four or more.
  const int64_t base = kScaled<T> ? 128 << 10 : 256 << 10;
  const int64_t share = O * value_bytes(kind, I) / (4 * std::max<int64_t>(pool.num_threads(), 1));
  const bool long_rows = long_items(kind, M, I);
  call->chunk = chunk_rows(value_bytes(kind, I), O,
                           long_rows ? std::clamp(share, base, kLongItems * base) : base);
  // Long items end in takes down to a quarter of the usual item; others keep theirs.
  call->least = long_rows ? chunk_rows(value_bytes(kind, I), O, base / 4) : call->chunk;
  // Work: the weights as float32, a pass for every four inputs (held rows cost their widening,
  // about what float32 rows cost to stream: a one-row call over 270 KB of int8 rows took a
  // core 26 µs).
  const int64_t work = O * I * int64_t{sizeof(float)} * ((M + 3) / 4);
  // A call worth sharing that one item would hold (int4 rows of up to 128 KiB of values: an
  // olmoe-sized [512, 512] took one core 12.7 µs) goes in an item a thread.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (work >= kSoloWork && O >= 16 * threads && (O + call->chunk - 1) / call->chunk < threads)
    call->chunk = call->least = ((O + threads - 1) / threads + 7) / 8 * 8;
  const int64_t items = O ? (O + call->chunk - 1) / call->chunk : 0;
  call->xrow.resize(M);
  for (int64_t m = 0; m < M; ++m) call->xrow[m] = x.typed_data() + m * I;
  if constexpr (kProducts<T>) {
    uint16_t* xs = reinterpret_cast<uint16_t*>(scratch<Scratch::kLinear>((M * I + 1) / 2));
    call->xb.resize(M);
    for (int64_t m = 0; m < M; ++m) {
      round_row(call->xrow[m], I, xs + m * I);
      call->xb[m] = xs + m * I;
    }
  } else if (kPairs && M >= kPairedFrom) {
    call->packed = Packed(scratch<Scratch::kLinear>(Packed::floats(M, I)), M, I);
    call->packed.pack(call->xrow.data());
  }
  run(pool, call, items, work, CallKind::kLinear, M);
  return ffi::Error::Success();
}

}  // namespace
