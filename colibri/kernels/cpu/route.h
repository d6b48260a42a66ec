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
  std::vector<float> p((E + 7) / 8 * 8);
  std::vector<char> taken(E);
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits.typed_data() + n * E;
    int32_t* out_i = ids->typed_data() + n * K;
    float* out_w = weights->typed_data() + n * K;
    float m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::fmax(m, l[e]);
    for (int64_t e = 0; e < E; ++e)
      if (std::isnan(l[e])) m = l[e];  // as jnp.max: every p NaN
    // e^(l - m) eight lanes at a time with the kernels' exp8, the last vector padded with
    // -inf (e^-inf = 0); the sum in eight lanes, then the fixed horizontal sum.
    const v8 mv = v8{} + m;
    v8 acc{};
    for (int64_t e = 0; e < E; e += 8) {
      v8 v = v8{} - INFINITY;
      std::memcpy(&v, l + e, sizeof(float) * std::min<int64_t>(8, E - e));
      const v8 x = exp8(v - mv);
      std::memcpy(p.data() + e, &x, sizeof x);
      acc += x;
    }
    const float sum = hsum(acc);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      out_i[k] = static_cast<int32_t>(best);
      out_w[k] = p[best];
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
