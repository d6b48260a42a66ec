// colibri_linear_heads and colibri_linear_heads_t: products of float32 rows x [M, H, I] with
// a matrix of their own for each head h, rows first .. of w [H, R, C] (C columns), as
// multi-head latent attention takes each head's query into the latent space and its latents
// out (attention.mla_attend_latent: the rows of kv_b, read where they lie). Each row's
// outputs are the same bits whatever rows it meets, as the other kernels' are (XLA's dot
// sums in an order that changes with the rows).

#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "attend.h"
#include "gang.h"
#include "pairs.h"
#include "tiles.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// colibri_linear_heads: y [M, H, O] = x [M, H, I] . w[h, first .. first + O)^T head by head
// (MLA's value rows of kv_b taking each head's latents out). Each head's outputs are those
// colibri_linear computes for x[:, h] and those rows, the same bits. Items of up to ~256 KiB
// of a head's rows, shared out among the threads; the thread that takes a head's first item
// packs its inputs for the paired tiles in its own scratch, its next items of that head
// reusing them.
struct HeadsCall : Gang {
  const float *x, *w;
  float* y;
  int64_t M, H, R, first, O, I, chunk, per_head, items;
  std::atomic<int64_t> next{0};

  void drain() override {
    std::vector<const float*> xrow(M);
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
      const float* rows = w + (h * R + first + o0) * I;
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

ffi::Error LinearHeads(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, int64_t first) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 3 || wd.size() != 3 || yd.size() != 3)
    return ffi::Error::InvalidArgument("colibri_linear_heads: wrong ranks");
  const int64_t M = xd[0], H = xd[1], I = xd[2], R = wd[1], O = yd[2];
  if (wd[0] != H || wd[2] != I || yd[0] != M || yd[1] != H || first < 0 || first + O > R)
    return ffi::Error::InvalidArgument("colibri_linear_heads: shapes disagree");
  auto call = std::make_shared<HeadsCall>();
  call->x = x.typed_data();
  call->w = w.typed_data();
  call->y = y->typed_data();
  call->M = M;
  call->H = H;
  call->R = R;
  call->first = first;
  call->O = O;
  call->I = I;
  call->chunk = chunk_rows(I * int64_t{sizeof(float)}, O, 256 << 10);
  call->per_head = O ? (O + call->chunk - 1) / call->chunk : 0;
  call->items = H * call->per_head;
  run(pool, call, call->items, H * O * I * int64_t{sizeof(float)} * ((M + 3) / 4));
  return ffi::Error::Success();
}

// colibri_linear_heads_t: y [M, H, C] = x [M, H, I] . w[h, first .. first + I) head by head:
// y[m, h] = sum over i of x[m, h, i] w[h, first + i], each column one multiply-add chain in
// order of i from zero, as attention sums its values (attend.h's `values`, whose tiles this
// takes: its probabilities are x's rows, its positions w's rows). An item a head, its sums
// in the thread's scratch, then copied out.
struct HeadsTCall : Gang {
  const float *x, *w;
  float* y;
  int64_t M, H, R, first, C, I;
  std::atomic<int64_t> next{0};

  void drain() override {
    std::vector<float> o(M * C);
    for (int64_t h; (h = next.fetch_add(1, std::memory_order_relaxed)) < H;) {
      std::fill(o.begin(), o.end(), 0.0f);
      AttendCall::values(x + h * I, H * I, w + (h * R + first) * C, 0, I, C, M, o.data(),
                         nullptr, 0);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(y + (m * H + h) * C, o.data() + m * C, sizeof(float) * C);
    }
  }
};

ffi::Error LinearHeadsT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::ResultBuffer<ffi::F32> y, int64_t first) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 3 || wd.size() != 3 || yd.size() != 3)
    return ffi::Error::InvalidArgument("colibri_linear_heads_t: wrong ranks");
  const int64_t M = xd[0], H = xd[1], I = xd[2], R = wd[1], C = wd[2];
  if (wd[0] != H || yd[0] != M || yd[1] != H || yd[2] != C || first < 0 || first + I > R)
    return ffi::Error::InvalidArgument("colibri_linear_heads_t: shapes disagree");
  auto call = std::make_shared<HeadsTCall>();
  call->x = x.typed_data();
  call->w = w.typed_data();
  call->y = y->typed_data();
  call->M = M;
  call->H = H;
  call->R = R;
  call->first = first;
  call->C = C;
  call->I = I;
  run(pool, call, H, H * I * C * int64_t{sizeof(float)} * ((M + 3) / 4));
  return ffi::Error::Success();
}

}  // namespace
