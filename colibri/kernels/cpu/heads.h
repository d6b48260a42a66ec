// colibri_linear_heads and colibri_linear_heads_t: products of float32 rows x [M, H, I] with
// a matrix of their own for each head h, rows first .. of w [H, R, C] (C columns, held in any
// format but bfloat16 products'), as multi-head latent attention takes each head's query into
// the latent space and its latents out (attention.mla_attend_latent: the rows of kv_b, read
// where they lie). Held rows are widened an item at a time into the thread's own float32
// (formats.h, tiles.h's widen_row: the float32 the checkpoint dequantizes to), then computed
// as float32 rows are, by the same code: bitwise what the rows widened beforehand give. Each row's outputs are
// the same bits whatever rows it meets, as the other kernels' are (XLA's dot sums in an order
// that changes with the rows).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "attend.h"
#include "formats.h"
#include "gang.h"
#include "pairs.h"
#include "tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows [row, row + n) of held rows w (T; ld elements apart, L values each, blk their block
// width) as float32, L apart, into wide (resized to fit); float32 rows are not copied: their
// own pointer comes back. The calls below take it by pointer: their arithmetic is float32's,
// compiled once, whatever the format.
using Widen = const float* (*)(const void* w, int64_t row, int64_t n, int64_t L, int64_t ld,
                               int64_t blk, std::vector<float>& wide);

template <typename T>
const float* widened(const void* base, int64_t row, int64_t n, int64_t L, int64_t ld,
                     int64_t blk, std::vector<float>& wide) {
  const T* w = static_cast<const T*>(base) + row * ld;
  if constexpr (std::is_same_v<T, float>) {
    return w;
  } else if constexpr (kProducts<T>) {  // (refused by held_rows)
    return nullptr;
  } else {
    [[maybe_unused]] std::conditional_t<kScaled<T>, KeepSubnormals, int> keep{};
    wide.resize(n * L);
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (kScaled<T>)
        widen_row(w + i * ld, L, blk, wide.data() + i * L);
      else
        for (int64_t c = 0; c < L; ++c) wide[i * L + c] = widen(w[i * ld + c]);
    }
    return wide.data();
  }
}

// The rows' element distance ld and block width blk of w [H, R, held] (buffer elements of
// WT) holding rows of L values as T, or an error naming `target`.
template <ffi::DataType WT, typename T>
ffi::Error held_rows(ffi::Buffer<WT>& w, int64_t L, const char* target, int64_t& ld,
                     int64_t& blk) {
  if constexpr (kProducts<T>)
    return ffi::Error::InvalidArgument(std::string(target) + ": not for bfloat16 products");
  const int64_t unit = sizeof(*w.typed_data()) / sizeof(T);  // T a buffer element (Int4Z: 4)
  ld = w.dimensions()[2] * unit;
  blk = 0;
  if constexpr (kScaled<T>) {
    blk = scale_width(static_cast<const T*>(nullptr), L, ld);
    if (blk == 0)
      return ffi::Error::InvalidArgument(std::string(target) +
                                         ": rows are not their values and block scales");
  } else if (ld != L) {
    return ffi::Error::InvalidArgument(std::string(target) + ": shapes disagree");
  }
  return ffi::Error::Success();
}

// What both targets' calls hold: x [M, H, I], y, and w [H, R, ...]: its rows first .. of each
// head, held (ld elements apart, blk their block width) and widened by `widen`.
struct HeadsOperands {
  const float* x;
  const void* w;
  Widen widen;
  float* y;
  int64_t M, H, I, R, first, ld, blk;
};

// The operands of `target` checked into `op`: x [M, H, I], w [H, R, held], y [M, H, out], and
// of each head `read` rows from `first` on of L values each (colibri_linear_heads: out rows of
// I values; colibri_linear_heads_t: I rows of out values).
template <ffi::DataType WT, typename T>
ffi::Error heads_operands(const char* target, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                          ffi::ResultBuffer<ffi::F32>& y, int64_t first, bool rows_are_inputs,
                          HeadsOperands& op) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 3 || wd.size() != 3 || yd.size() != 3)
    return ffi::Error::InvalidArgument(std::string(target) + ": wrong ranks");
  op.M = xd[0], op.H = xd[1], op.I = xd[2], op.R = wd[1], op.first = first;
  const int64_t out = yd[2], read = rows_are_inputs ? op.I : out;
  if (wd[0] != op.H || yd[0] != op.M || yd[1] != op.H || first < 0 || first + read > op.R)
    return ffi::Error::InvalidArgument(std::string(target) + ": shapes disagree");
  op.x = x.typed_data();
  op.w = w.typed_data();
  op.widen = &widened<T>;
  op.y = y->typed_data();
  return held_rows<WT, T>(w, rows_are_inputs ? out : op.I, target, op.ld, op.blk);
}

// colibri_linear_heads: y [M, H, O] = x [M, H, I] . w[h, first .. first + O)^T head by head
// (MLA's value rows of kv_b taking each head's latents out). Each head's outputs are those
// colibri_linear computes for x[:, h] and those rows, the same bits. Items of up to ~256 KiB
// of a head's rows, shared out among the threads; the thread that takes a head's first item
// packs its inputs for the paired tiles in its own scratch, its next items of that head
// reusing them.
struct HeadsCall : Gang, HeadsOperands {
  int64_t O, chunk, per_head, items;
  std::atomic<int64_t> next{0};

  void drain() override {
    std::vector<const float*> xrow(M);
    std::vector<float> wide;
    Packed packed;
    for (int64_t k, h = -1; (k = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      if (k / per_head != h) {
        h = k / per_head;
        for (int64_t m = 0; m < M; ++m) xrow[m] = x + (m * H + h) * I;
        if (kPairs && M >= kPairedFrom) {
          packed = Packed(scratch<Scratch::kLinear>(Packed::floats(M, I)), M, I);
          packed.pack(xrow.data());
        }
      }
      const int64_t o0 = k % per_head * chunk, no = std::min(chunk, O - o0);
      const float* rows = widen(w, h * R + first + o0, no, I, ld, blk, wide);
      auto apply = [&](auto emit) {
        if (packed.r)
          matvecs(rows, no, I, packed, emit, I, 0);
        else
          matvecs(rows, no, I, xrow.data(), M, emit, I, 0);
      };
      through_item_buffer(no, M, apply, [&](int64_t o, int64_t m, float v) {
        y[(m * H + h) * O + o0 + o] = v;
      });
    }
  }
};

template <ffi::DataType WT, typename T>
ffi::Error LinearHeads(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                       ffi::ResultBuffer<ffi::F32> y, int64_t first) {
  auto call = std::make_shared<HeadsCall>();
  if (auto e = heads_operands<WT, T>("colibri_linear_heads", x, w, y, first, false, *call);
      e.failure())
    return e;
  const int64_t O = call->O = y->dimensions()[2], I = call->I;
  call->chunk = chunk_rows(I * int64_t{sizeof(float)}, O, 256 << 10);
  call->per_head = O ? (O + call->chunk - 1) / call->chunk : 0;
  call->items = call->H * call->per_head;
  run(pool, call, call->items, call->H * O * I * int64_t{sizeof(float)} * ((call->M + 3) / 4),
      CallKind::kHeads, call->M);
  return ffi::Error::Success();
}

// colibri_linear_heads_t: y [M, H, C] = x [M, H, I] . w[h, first .. first + I) head by head:
// y[m, h] = sum over i of x[m, h, i] w[h, first + i], each column one multiply-add chain in
// order of i from zero, as attention sums its values (attend.h's `values`, whose tiles this
// takes: its probabilities are x's rows, its positions w's rows). An item a head, its sums
// in the thread's scratch, then copied out.
struct HeadsTCall : Gang, HeadsOperands {
  int64_t C;
  std::atomic<int64_t> next{0};

  void drain() override {
    std::vector<float> o(M * C), wide;
    for (int64_t h; (h = next.fetch_add(1, std::memory_order_relaxed)) < H;) {
      std::fill(o.begin(), o.end(), 0.0f);
      const float* rows = widen(w, h * R + first, I, C, ld, blk, wide);
      AttendCall::values(x + h * I, H * I, rows, 0, I, C, M, o.data(), nullptr, 0);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + (m * H + h) * C, o.data() + m * C, sizeof(float) * C);
    }
  }
};

template <ffi::DataType WT, typename T>
ffi::Error LinearHeadsT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                        ffi::ResultBuffer<ffi::F32> y, int64_t first) {
  auto call = std::make_shared<HeadsTCall>();
  if (auto e = heads_operands<WT, T>("colibri_linear_heads_t", x, w, y, first, true, *call);
      e.failure())
    return e;
  const int64_t C = call->C = y->dimensions()[2], H = call->H;
  run(pool, call, H, H * call->I * C * int64_t{sizeof(float)} * ((call->M + 3) / 4),
      CallKind::kHeads, call->M);
  return ffi::Error::Success();
}

}  // namespace
