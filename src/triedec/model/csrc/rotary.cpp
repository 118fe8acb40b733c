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

template <typename scalar_t>
void rotate_rows(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& out) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* cp = cos.data_ptr<scalar_t>();
  const scalar_t* sp = sin.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t cs0 = cos.stride(0), cs1 = cos.stride(1);
  const int64_t ss0 = sin.stride(0), ss1 = sin.stride(1);
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

}  // namespace

// x [B, H, T, D] (any strides but a unit last one), cos and sin [B, T, D] (the same; a unit last
// stride), all of one dtype, D even. Returns a new contiguous [B, H, T, D].
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "x must be [B, H, T, D] with an even D");
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.size(2) == x.size(3), "cos and sin must be [B, T, D] for x [B, H, T, D]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "x, cos and sin share a dtype");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "float32, bfloat16 or float16");
  if (x.stride(3) != 1) x = x.contiguous();
  if (cos.stride(2) != 1) cos = cos.contiguous();
  if (sin.stride(2) != 1) sin = sin.contiguous();
  torch::Tensor out = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  if (dtype == at::kFloat) rotate_rows<float>(x, cos, sin, out);
  else if (dtype == at::kBFloat16) rotate_rows<c10::BFloat16>(x, cos, sin, out);
  else rotate_rows<c10::Half>(x, cos, sin, out);
  return out;
}
