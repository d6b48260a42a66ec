// colibri_route_softmax: a softmax router's choice for each row, from its logits: the top k
// experts of softmax(logits) and their weights (renormalised to sum to 1 where asked), one
// call instead of XLA's max, exp, sum, divide, TopK and renormalising ops.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// logits [N, E] -> ids [N, K] int32, weights [N, K]. Per row, as jax.nn.softmax and
// jax.lax.top_k compute it: p = exp(l - max l) / sum of those (simd.h's exp8, the sum in
// eight lanes); the K largest p, largest first, the lower expert first where two are equal;
// with `norm`, each divided by the sum of the K (in order of k). A row with a NaN logit gets
// NaN weights and experts 0 .. K - 1 (no p compares above another).
ffi::Error RouteSoftmax(ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> ids,
                        ffi::ResultBuffer<ffi::F32> weights, int32_t norm) {
  const auto ld = logits.dimensions(), id = ids->dimensions(), wd = weights->dimensions();
  if (ld.size() != 2 || id.size() != 2 || wd.size() != 2)
    return ffi::Error::InvalidArgument("colibri_route_softmax: wrong ranks");
  const int64_t N = ld[0], E = ld[1], K = id[1];
  if (id[0] != N || wd[0] != N || wd[1] != K || K > E || K < 1)
    return ffi::Error::InvalidArgument("colibri_route_softmax: shapes disagree");
  const int64_t E8 = (E + 7) / 8 * 8;
  std::vector<float> p(E8);
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits.typed_data() + n * E;
    int32_t* out_i = ids->typed_data() + n * K;
    float* out_w = weights->typed_data() + n * K;
    // The logits in vectors of eight, the last padded with -inf (e^-inf = 0).
    std::fill(p.end() - 8, p.end(), -INFINITY);
    std::memcpy(p.data(), l, sizeof(float) * E);
    v8 mv = v8{} - INFINITY;
    bool nan = false;
    for (int64_t e = 0; e < E8; e += 8) {
      const v8 v = load8(p.data() + e);
      mv = max8(mv, v);
      for (int i = 0; i < 8; ++i) nan |= v[i] != v[i];
    }
    float m = mv[0];
    for (int i = 1; i < 8; ++i) m = std::max(m, mv[i]);
    if (nan) m = NAN;  // as jnp.max: every p NaN
    // e^(l - m) with the kernels' exp8; the sum in eight lanes, then the fixed horizontal sum.
    const v8 m8 = v8{} + m;
    v8 acc{};
    for (int64_t e = 0; e < E8; e += 8) {
      const v8 x = exp8(load8(p.data() + e) - m8);
      std::memcpy(p.data() + e, &x, sizeof x);
      acc += x;
    }
    const v8 sum = v8{} + hsum(acc);
    for (int64_t e = 0; e < E8; e += 8) {
      const v8 x = load8(p.data() + e) / sum;
      std::memcpy(p.data() + e, &x, sizeof x);
    }
    // The K largest so far, largest first, kept by insertion: p[e] goes after every kept
    // value not below it, so that of two equal values the lower expert stays first.
    int64_t kept = 0;
    for (int64_t e = 0; e < E; ++e) {
      if (kept == K && !(p[e] > out_w[K - 1])) continue;
      int64_t j = kept < K ? kept++ : K - 1;
      for (; j > 0 && p[e] > out_w[j - 1]; --j) {
        out_w[j] = out_w[j - 1];
        out_i[j] = out_i[j - 1];
      }
      out_w[j] = p[e];
      out_i[j] = static_cast<int32_t>(e);
    }
    if (norm) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += out_w[k];
      for (int64_t k = 0; k < K; ++k) out_w[k] /= s;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
