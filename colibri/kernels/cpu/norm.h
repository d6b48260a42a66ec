// colibri_rms_norm: RMSNorm of a few rows, w * (x * 1 / sqrt(mean(x^2) + eps)), in one call
// instead of XLA's four (the squares, their partial sums, the reciprocal root, the scaling).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// x [N, D], w [D] -> y [N, D]. Each row's squares summed in eight lanes in order of column
// (then the fixed horizontal sum and the tail), as the kernels' dot products are: a row's
// result depends on that row alone.
ffi::Error RmsNorm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y, float eps) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 1 || !(yd == xd) || wd[0] != xd[1])
    return ffi::Error::InvalidArgument("colibri_rms_norm: shapes disagree");
  const int64_t N = xd[0], D = xd[1], D8 = D / 8 * 8;
  const float* wv = w.typed_data();
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x.typed_data() + n * D;
    float* yr = y->typed_data() + n * D;
    v8 acc{};
    for (int64_t c = 0; c < D8; c += 8) {
      const v8 v = load8(xr + c);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (int64_t c = D8; c < D; ++c) ss += xr[c] * xr[c];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    const v8 rv = v8{} + r;
    for (int64_t c = 0; c < D8; c += 8) {
      const v8 v = load8(wv + c) * (load8(xr + c) * rv);
      std::memcpy(yr + c, &v, sizeof v);
    }
    for (int64_t c = D8; c < D; ++c) yr[c] = wv[c] * (xr[c] * r);
  }
  return ffi::Error::Success();
}

}  // namespace
