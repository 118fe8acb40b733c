// The native forward's elementwise steps (kernels.h): each element is one float32 operation on the
// bfloat16 inputs, rounded to bfloat16 (nearest even), as torch's bfloat16 add and mul give it. In
// the kernel libraries, so that each instruction set's build vectorizes them its own way (the bits
// are the same: one IEEE operation per element).
#include "kernels.h"

namespace triedec {

using bf16 = c10::BFloat16;

void add_bf16(bf16* h, const bf16* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<bf16>(static_cast<float>(h[i]) + static_cast<float>(y[i]));
}

void mul_bf16_rows(const bf16* a, int64_t a_ld, const bf16* b, int64_t b_ld, bf16* out, int64_t R, int64_t n) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i)
      out[r * n + i] = static_cast<bf16>(static_cast<float>(a[r * a_ld + i]) * static_cast<float>(b[r * b_ld + i]));
}

void add_bias_bf16(bf16* out, const bf16* bias, int64_t R, int64_t N) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t n = 0; n < N; ++n)
      out[r * N + n] = static_cast<bf16>(static_cast<float>(out[r * N + n]) + static_cast<float>(bias[n]));
}

}  // namespace triedec
