// Rotary position embedding of queries or keys in one call (triedec's own kernel; see
// triedec/model/runner.py), the same bits as transformers' `apply_rotary_pos_emb` with its
// `rotate_half` (the halves layout Llama and Qwen2 use):
//   out_d = round(round(x_d * cos_d) + round(-x_{d + D/2} * sin_d))      for d < D/2
//   out_d = round(round(x_d * cos_d) + round(x_{d - D/2} * sin_d))       for d >= D/2
// where round() is to x's dtype (nearest even; the identity in float32): transformers' eager ops,
// each of which computes in float32 and rounds once to the dtype. Each element is computed from
// its own row only, so the bits do not depend on the call, the thread count or the order.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cstdint>

namespace {

template <typename scalar_t>
inline float rounded(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

}  // namespace

namespace triedec {

template <typename scalar_t>
void rotary_rows(const scalar_t* xp, const int64_t* x_strides, const scalar_t* cp, const int64_t* cos_strides,
                 const scalar_t* sp, const int64_t* sin_strides, scalar_t* op, int64_t B, int64_t H, int64_t T,
                 int64_t D) {
  const int64_t half = D / 2;
  const int64_t xs0 = x_strides[0], xs1 = x_strides[1], xs2 = x_strides[2];
  const int64_t cs0 = cos_strides[0], cs1 = cos_strides[1];
  const int64_t ss0 = sin_strides[0], ss1 = sin_strides[1];
  at::parallel_for(0, B * H * T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / (H * T), h = (row / T) % H, t = row % T;
      const scalar_t* xr = xp + b * xs0 + h * xs1 + t * xs2;
      const scalar_t* c = cp + b * cs0 + t * cs1;
      const scalar_t* s = sp + b * ss0 + t * ss1;
      scalar_t* o = op + row * D;
      for (int64_t d = 0; d < half; ++d) {
        const float kept = rounded<scalar_t>(static_cast<float>(xr[d]) * static_cast<float>(c[d]));
        const float turned = rounded<scalar_t>(-static_cast<float>(xr[d + half]) * static_cast<float>(s[d]));
        o[d] = static_cast<scalar_t>(kept + turned);
      }
      for (int64_t d = half; d < D; ++d) {
        const float kept = rounded<scalar_t>(static_cast<float>(xr[d]) * static_cast<float>(c[d]));
        const float turned = rounded<scalar_t>(static_cast<float>(xr[d - half]) * static_cast<float>(s[d]));
        o[d] = static_cast<scalar_t>(kept + turned);
      }
    }
  });
}

#define TRIEDEC_ROTARY(T_)                                                                                 \
  template void rotary_rows<T_>(const T_*, const int64_t*, const T_*, const int64_t*, const T_*, const int64_t*, T_*, \
                                int64_t, int64_t, int64_t, int64_t);
TRIEDEC_ROTARY(float)
TRIEDEC_ROTARY(c10::BFloat16)
TRIEDEC_ROTARY(c10::Half)
#undef TRIEDEC_ROTARY

}  // namespace triedec
