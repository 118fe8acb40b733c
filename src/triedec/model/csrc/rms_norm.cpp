// RMS norm of each row with a fixed reduction order (triedec's own kernel; see triedec/fused.py).
//
// For a row x of D features (float32, bfloat16 or float16; computed in float32):
//   s = sum_d x_d^2, as 8 partial sums (d mod 8), each in d order, combined ((0+1)+(2+3))+((4+5)+(6+7));
//   r = 1 / sqrt(s / D + eps)                      (IEEE division and square root: correctly rounded)
// and then, as the two kinds of RMS norm transformers' models define it:
//   weight:          y_d = round(w_d * round(x_d * r))     (Llama, Qwen, Mistral, SmolLM, ...)
//   one_plus_weight: y_d = round((x_d * r) * (1 + w_d))    (Gemma: the scale is 1 + w, in float32)
// where round() is to the input's dtype (nearest even; the identity in float32). Every operation
// is one IEEE operation in float32 (the file is compiled with -ffp-contract=off and without
// -ffast-math), and a row's sums depend on its own features only, so a row gets the same bits
// alone or inside any call; threads split rows, each computing whole rows. The outputs differ
// from torch's composite (pow, mean, rsqrt, mul) by the order of the sum of squares only.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 8;

}  // namespace

namespace triedec {

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t row_stride, const scalar_t* w, scalar_t* out, int64_t rows, int64_t D,
               float eps, bool one_plus) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(D), wf(D);
    for (int64_t d = 0; d < D; ++d) wf[d] = static_cast<float>(w[d]);
    if (one_plus)
      for (int64_t d = 0; d < D; ++d) wf[d] = 1.0f + wf[d];
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * row_stride;
      scalar_t* o = out + r * D;
      for (int64_t d = 0; d < D; ++d) xf[d] = static_cast<float>(xr[d]);
      float part[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes)
        for (int j = 0; j < kLanes; ++j) {
          const float sq = xf[d + j] * xf[d + j];
          part[j] = part[j] + sq;
        }
      for (int j = 0; d + j < D; ++j) {
        const float sq = xf[d + j] * xf[d + j];
        part[j] = part[j] + sq;
      }
      const float sum = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
      const float mean = sum / static_cast<float>(D);
      const float inv = 1.0f / std::sqrt(mean + eps);
      if (one_plus) {
        for (int64_t k = 0; k < D; ++k) {
          const float normed = xf[k] * inv;
          o[k] = static_cast<scalar_t>(normed * wf[k]);
        }
      } else {
        for (int64_t k = 0; k < D; ++k) {
          const float normed = static_cast<float>(static_cast<scalar_t>(xf[k] * inv));
          o[k] = static_cast<scalar_t>(wf[k] * normed);
        }
      }
    }
  });
}

template void rms_norm_rows<float>(const float*, int64_t, const float*, float*, int64_t, int64_t, float, bool);
template void rms_norm_rows<c10::BFloat16>(const c10::BFloat16*, int64_t, const c10::BFloat16*, c10::BFloat16*, int64_t,
                                           int64_t, float, bool);
template void rms_norm_rows<c10::Half>(const c10::Half*, int64_t, const c10::Half*, c10::Half*, int64_t, int64_t, float,
                                       bool);

}  // namespace triedec
