// triedec's native forward of a Llama-family, Gemma 2/3, OLMo 2 or Granite decoder (decoder.h). Per
// layer, in the order transformers' LlamaDecoderLayer / Gemma3DecoderLayer runs it and
// triedec/model/runner.py's Python walk calls it:
//   x = rms_norm(h) [OLMo 2: x = h]; q | k | v = x Wqkv (+ b); [Qwen3, Gemma 3: q, k = q_norm(q),
//   k_norm(k) per head; OLMo 2: over the whole projection];
//   q, k = rotary(q), rotary(k) (the layer kind's table; SmolLM3: not on its layers without rotary);
//   K/V into each item's cache; a = tree_attention(q, cache) (the layer kind's key lists; Gemma 2:
//   its scores soft-capped); y = a Wo; [Gemma, OLMo 2: y = rms_norm(y)]; [Granite: y = y * s];
//   h = h + y; x = rms_norm(h) [OLMo 2: x = h]; g | u = x Wgu; y = (act(g) * u) Wd;
//   [Gemma, OLMo 2: y = rms_norm(y)]; [Granite: y = y * s]; h = h + y
// then the final norm and the LM head on the kept rows. act is torch's silu or tanh-gelu. Every step
// is the kernel or the one IEEE operation per element that the Python walk runs (the residual adds,
// Granite's scaling and the product act(g) * u are one float32 operation rounded to bfloat16, as
// torch's bfloat16 ops are; the activation is torch's own op on every element's vector path:
// gated_rows), so the logits are the same bits
// (tests/test_runner.py). The embedding's and the logits' own scalings (Gemma, Granite) and the final
// soft-cap are the Python side's torch ops, before and after this call.
// On float32 activations (the float mode: triedec's float32 linears) the norms are transformers'
// own torch ops (aten_rms_norm), the adds and the product plain float32 operations.
// Rows depend on their own inputs only: every kernel computes a row alone, and attention reads the
// slots a row sees.
#include "decoder.h"

#include "kernel_table.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mean.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/pow.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace triedec {

namespace {

using bf16 = c10::BFloat16;

void check_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), what,
              " must be a contiguous bfloat16 CPU tensor");
}

// a norm's or a bias's weight: a contiguous CPU tensor in the activations' dtype (bf16 or float32)
void check_act(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat) &&
                  t.is_contiguous(), what, " must be a contiguous bfloat16 or float32 CPU tensor");
}

template <typename T>
constexpr at::ScalarType dtype_of() {
  return std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
}

// rows [R, K] W^T as the torch op a mode's stand-in calls gives it: int8's or int4's weight-only op
// (no bias), or oneDNN's pre-packed linear as PackedLinear.rows (the bias in the op) or
// SplitLinear.rows (the pieces' outputs added in order, then the bias).
at::Tensor torch_linear(const NativeLinear& l, const at::Tensor& rows) {
  if (l.kind == NativeLinear::kInt8) return at::_weight_int8pack_mm(rows, l.packed, l.scales);
  if (l.kind == NativeLinear::kInt4) return at::_weight_int4pack_mm_for_cpu(rows, l.packed, kA8Group, l.scales);
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                        c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  const auto call = [](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
    return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
  };
  if (!l.split) return call(rows, l.pieces[0], l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt);
  at::Tensor y;
  for (size_t i = 0; i < l.pieces.size(); ++i) {
    const at::Tensor piece = call(rows.narrow(1, l.bounds[i], l.bounds[i + 1] - l.bounds[i]), l.pieces[i], c10::nullopt);
    y = i == 0 ? piece : at::add(y, piece);
  }
  return l.bias.defined() ? at::add(y, l.bias) : y;
}

// out [R, N] = x [R, K] W^T (+ bias), as the linear's own op gives it: triedec's kernel, or the
// torch op the mode's stand-in calls (on the same rows, so the same bits), its result copied out.
void run_linear(const NativeLinear& l, const float* x, int64_t R, float* out) {
  TORCH_CHECK(l.kind == NativeLinear::kF32, "float32 activations take float32 linears only");
  kernels().f32_linear_rows(x, R, l.K, l.packed.data_ptr<float>(), l.bias.defined() ? l.bias.data_ptr<float>() : nullptr,
                            l.N, out);
}

void run_linear(const NativeLinear& l, const bf16* x, int64_t R, bf16* out) {
  const KernelTable& kern = kernels();
  TORCH_CHECK(l.kind != NativeLinear::kF32, "bfloat16 activations take no float32 linear");
  if (l.kind == NativeLinear::kA8Int4) {
    kern.int4_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(), l.scales.data_ptr<bf16>(), l.N, out, false);
  } else if (l.kind == NativeLinear::kA8Int8) {
    kern.int8_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(), l.scales.data_ptr<c10::Half>(), l.N, out, false);
  } else if (l.kind == NativeLinear::kA8Int5) {
    kern.int5_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(), l.highs.data_ptr<uint8_t>(),
                          l.scales.data_ptr<c10::Half>(), l.N, out, false);
  } else if (l.kind == NativeLinear::kA8KQuant) {
    kern.kquant_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(),
                            l.highs.size(1) ? l.highs.data_ptr<uint8_t>() : nullptr, l.scales.data_ptr<int8_t>(),
                            l.supers.data_ptr<float>(), l.N, out, false);
  } else if (l.kind == NativeLinear::kA8ScaleMin) {
    kern.scale_min_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(),
                               l.highs.size(1) ? l.highs.data_ptr<uint8_t>() : nullptr, l.scales.data_ptr<c10::Half>(),
                               l.scales.size(1) == 2, l.N, out, false);
  } else if (l.kind == NativeLinear::kA8Int6) {
    kern.int6_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(), l.highs.data_ptr<uint8_t>(),
                          l.scales.data_ptr<int8_t>(), l.supers.data_ptr<float>(), l.N, out, false);
  } else {
    const at::Tensor y = torch_linear(l, at::from_blob(const_cast<bf16*>(x), {R, l.K},
                                                       at::TensorOptions().dtype(at::kBFloat16)));
    TORCH_CHECK(y.is_contiguous() && y.size(0) == R && y.size(1) == l.N, "a linear's torch op returned another shape");
    std::memcpy(out, y.data_ptr<bf16>(), R * l.N * sizeof(bf16));
    if (l.kind == NativeLinear::kOneDnn) return;  // its bias is in y
  }
  if (l.bias.defined()) kern.add_bias_bf16(out, l.bias.data_ptr<bf16>(), R, l.N);
}

// The parts' outputs side by side in out [R, width]: one linear writes out directly; several are
// each computed alone (their own bits) and copied into their columns.
template <typename T>
void run_parts(const std::vector<NativeLinear>& parts, const T* x, int64_t R, T* out, int64_t width) {
  if (parts.size() == 1) {
    run_linear(parts[0], x, R, out);
    return;
  }
  int64_t at = 0;
  for (const NativeLinear& l : parts) {
    at::Tensor part = at::empty({R, l.N}, dtype_of<T>());
    run_linear(l, x, R, part.data_ptr<T>());
    const T* p = part.data_ptr<T>();
    for (int64_t r = 0; r < R; ++r) std::memcpy(out + r * width + at, p + r * l.N, l.N * sizeof(T));
    at += l.N;
  }
}

// The elementwise steps on float32 activations: one float32 operation per element, as torch's
// float32 add and mul (the extension is built with -ffp-contract=off).
void add_rows(float* h, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += y[i];
}
void mul_rows(const float* a, int64_t a_ld, const float* b, int64_t b_ld, float* out, int64_t R, int64_t n) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = a[r * a_ld + i] * b[r * b_ld + i];
}
void add_rows(bf16* h, const bf16* y, int64_t n) { kernels().add_bf16(h, y, n); }
// The rotary kinds the kernel table's rotary does not do, as the modeling files compute them: x
// [H, N, D] at strides x_st (head, row) into out [H, N, D], rotated on its first `rot` features
// (Phi-4-mini: a part of each head; else rot = D), the rest copied:
//   out_d = round(round(x_d * cos_d) + round(-x_{d + rot/2} * sin_d))      d < rot/2 (the other half
//   with +x_{d - rot/2}), each product rounded to T as transformers' Llama rotary does on T tables;
// or, on float32 tables (OLMo 2's rotary, Table = float and T = bf16): the products and their sum
// in float32 and one rounding to T.
template <typename T, typename Table>
void own_rotary(const T* x, const int64_t* x_st, const Table* c, const Table* s, T* out, int64_t H, int64_t N,
                int64_t D, int64_t rot) {
  const int64_t half = rot / 2;
  const auto round = [](float v) {
    if constexpr (std::is_same_v<Table, T>) return static_cast<float>(static_cast<T>(v));
    else return v;
  };
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < N; ++r) {
      const T* xr = x + h * x_st[1] + r * x_st[2];
      const Table *cr = c + r * rot, *sr = s + r * rot;
      T* o = out + (h * N + r) * D;
      for (int64_t d = 0; d < half; ++d) {
        const float kept = round(static_cast<float>(xr[d]) * static_cast<float>(cr[d]));
        const float turned = round(-static_cast<float>(xr[d + half]) * static_cast<float>(sr[d]));
        o[d] = static_cast<T>(kept + turned);
      }
      for (int64_t d = half; d < rot; ++d) {
        const float kept = round(static_cast<float>(xr[d]) * static_cast<float>(cr[d]));
        const float turned = round(static_cast<float>(xr[d - half]) * static_cast<float>(sr[d]));
        o[d] = static_cast<T>(kept + turned);
      }
      for (int64_t d = rot; d < D; ++d) o[d] = xr[d];
    }
}

// y = round(y * s), as torch's product of a tensor and a Python float (the scalar as a float32)
void scale_rows(float* y, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= s;
}
void scale_rows(bf16* y, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16(static_cast<float>(y[i]) * s);
}
void mul_rows(const bf16* a, int64_t a_ld, const bf16* b, int64_t b_ld, bf16* out, int64_t R, int64_t n) {
  kernels().mul_bf16_rows(a, a_ld, b, b_ld, out, R, n);
}

// act(g) * u of each row, g and u the two halves of gu [R, 2 I], into out [R, I]. The activation
// is torch's own op, applied so that every element goes through its vector function: torch's
// elementwise loop leaves a call's last elements past a multiple of two vectors (16 to 64 of them)
// to a scalar version (silu's std::exp, gelu's std::tanh), which can round differently, and a
// call of over 32,768 elements (gelu: 16,384) is cut among the threads at points that need not
// fall on a vector, so which elements of a row went the scalar way depended on N and the thread
// count (a tree's rows could differ from plain decoding's where the intermediate size is no
// multiple of the vector).
// Here each call covers whole rows of g copied into rows padded to a multiple of kActPad, at most
// kActElements elements, inside this loop's thread (a nested parallel_for runs on its caller), so
// no element is in a tail and a row's bits depend on its own inputs only.
constexpr int64_t kActPad = 64;          // two AVX-512 vectors of bfloat16: every build's step divides it
constexpr int64_t kActElements = 16384;  // a call this size is not cut among threads (gelu cuts past it)
template <typename T>
void gated_rows(const T* gu, int64_t R, int64_t I, bool gelu, T* out) {
  const int64_t width = (I + kActPad - 1) / kActPad * kActPad;
  const int64_t per_call = std::max<int64_t>(1, kActElements / width);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    at::Tensor g = at::zeros({std::min(per_call, r1 - r0), width}, at::TensorOptions().dtype(dtype_of<T>()));
    T* gp = g.data_ptr<T>();
    for (int64_t a = r0; a < r1; a += per_call) {
      const int64_t rows = std::min(per_call, r1 - a);
      for (int64_t r = 0; r < rows; ++r) std::memcpy(gp + r * width, gu + (a + r) * 2 * I, I * sizeof(T));
      at::Tensor part = g.narrow(0, 0, rows);
      if (gelu) at::gelu_(part, "tanh");
      else at::silu_(part);
      mul_rows(gp, width, gu + a * 2 * I + I, 2 * I, out + a * I, rows, I);
    }
  });
}

int64_t total_out(const std::vector<NativeLinear>& parts) {
  int64_t n = 0;
  for (const NativeLinear& l : parts) n += l.N;
  return n;
}

NativeLinear::Kind linear_kind(const std::string& kind) {
  if (kind == "f32") return NativeLinear::kF32;
  if (kind == "a8-int4") return NativeLinear::kA8Int4;
  if (kind == "a8-int8") return NativeLinear::kA8Int8;
  if (kind == "a8-int5") return NativeLinear::kA8Int5;
  if (kind == "a8-int6") return NativeLinear::kA8Int6;
  if (kind == "a8-kquant") return NativeLinear::kA8KQuant;
  if (kind == "a8-scale-min") return NativeLinear::kA8ScaleMin;
  if (kind == "int8") return NativeLinear::kInt8;
  TORCH_CHECK(kind == "int4",
              "a linear's kind is f32, a8-int4, a8-int8, a8-int5, a8-int6, a8-kquant, a8-scale-min, int8 or int4, not ",
              kind);
  return NativeLinear::kInt4;
}

}  // namespace

at::Tensor aten_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool one_plus) {
  const at::Tensor normed = at::mul(x, at::rsqrt(at::add(at::mean(at::pow(x, 2), {-1}, true), eps)));
  return one_plus ? at::mul(normed, at::add(weight, 1.0)) : at::mul(weight, normed);
}

NativeLinear::NativeLinear(const std::string& kind_, at::Tensor packed_, c10::optional<at::Tensor> scales_,
                           c10::optional<at::Tensor> bias_, int64_t in_features, c10::optional<at::Tensor> highs_,
                           c10::optional<at::Tensor> supers_)
    : kind(linear_kind(kind_)), packed(std::move(packed_)), scales(scales_.value_or(at::Tensor())),
      bias(bias_.value_or(at::Tensor())), highs(highs_.value_or(at::Tensor())),
      supers(supers_.value_or(at::Tensor())), K(in_features) {
  TORCH_CHECK(highs.defined() == (kind == kA8Int5 || kind == kA8Int6 || kind == kA8KQuant || kind == kA8ScaleMin),
              "an a8-int5, a8-int6, a8-kquant or a8-scale-min linear, and only they, take planes of high bits");
  TORCH_CHECK(supers.defined() == (kind == kA8Int6 || kind == kA8KQuant),
              "an a8-int6 or a8-kquant linear, and only they, take super-block scales");
  if (kind == kF32) {
    TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.dim() == 2 &&
                    packed.scalar_type() == at::kFloat && packed.size(1) == K && packed.size(0) % 16 == 0,
                "an f32 linear's packed weight must be contiguous float32 [N, K], N a multiple of 16");
    N = packed.size(0);
    TORCH_CHECK(!bias.defined() || (bias.device().is_cpu() && bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                                    bias.dim() == 1 && bias.size(0) == N), "an f32 linear's bias must be float32 [N]");
    return;
  }
  TORCH_CHECK(scales.defined(), "a quantized linear needs its scales");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.scalar_type() == (kind == kInt8 ? at::kChar : at::kByte),
              "packed codes must be a contiguous 2-D CPU tensor (int8 for int8, else uint8)");
  N = packed.size(0);
  TORCH_CHECK(K > 0 && K % kA8Group == 0, "input features must be a multiple of 32");
  TORCH_CHECK(packed.size(1) == ((kind == kA8Int4 || kind == kInt4 || kind == kA8Int5 || kind == kA8Int6 ||
                                  kind == kA8KQuant || kind == kA8ScaleMin) ? K / 2 : K),
              "packed codes must be [N, K] (4-, 5- and 6-bit: [N, K / 2])");
  TORCH_CHECK(scales.device().is_cpu() && scales.is_contiguous(), "scales must be contiguous");
  switch (kind) {
    case kA8Int4:
      TORCH_CHECK(N % kA8Cols == 0, "output features must be a multiple of 16");
      TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(0) == K / kA8Group &&
                      scales.size(1) == 2 && scales.size(2) == N, "scales_zeros must be bf16 [K / 32, 2, N]");
      break;
    case kA8Int5:
      TORCH_CHECK(highs.device().is_cpu() && highs.is_contiguous() && highs.scalar_type() == at::kByte &&
                      highs.dim() == 2 && highs.size(0) == N && highs.size(1) == K / 8,
                  "an a8-int5 linear's fifth bits must be contiguous uint8 [N, K / 8]");
      [[fallthrough]];
    case kA8Int8:
      TORCH_CHECK(N % kA8Cols == 0, "output features must be a multiple of 16");
      TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == K / kA8Group &&
                      scales.size(1) == N, "scales must be fp16 [K / 32, N]");
      break;
    case kA8Int6:
      TORCH_CHECK(N % kA8Cols == 0 && K % 256 == 0, "an a8-int6 linear needs N a multiple of 16 and K of 256");
      TORCH_CHECK(highs.device().is_cpu() && highs.is_contiguous() && highs.scalar_type() == at::kByte &&
                      highs.dim() == 2 && highs.size(0) == N && highs.size(1) == K / 4,
                  "an a8-int6 linear's high bits must be contiguous uint8 [N, K / 4]");
      TORCH_CHECK(scales.scalar_type() == at::kChar && scales.dim() == 2 && scales.size(0) == K / 16 &&
                      scales.size(1) == N, "an a8-int6 linear's scales must be int8 [K / 16, N]");
      TORCH_CHECK(supers.device().is_cpu() && supers.is_contiguous() && supers.scalar_type() == at::kFloat &&
                      supers.dim() == 2 && supers.size(0) == K / 256 && supers.size(1) == N,
                  "an a8-int6 linear's super-block scales must be contiguous float32 [K / 256, N]");
      break;
    case kA8KQuant:
      TORCH_CHECK(N % kA8Cols == 0 && K % 256 == 0, "an a8-kquant linear needs N a multiple of 16 and K of 256");
      TORCH_CHECK(highs.device().is_cpu() && highs.is_contiguous() && highs.scalar_type() == at::kByte &&
                      highs.dim() == 2 && highs.size(0) == N && (highs.size(1) == 0 || highs.size(1) == K / 8),
                  "an a8-kquant linear's fifth bits must be contiguous uint8 [N, K / 8] (Q5_K) or [N, 0] (Q4_K)");
      TORCH_CHECK(scales.scalar_type() == at::kChar && scales.dim() == 3 && scales.size(0) == K / kA8Group &&
                      scales.size(1) == 2 && scales.size(2) == N, "an a8-kquant linear's scales must be int8 [K / 32, 2, N]");
      TORCH_CHECK(supers.device().is_cpu() && supers.is_contiguous() && supers.scalar_type() == at::kFloat &&
                      supers.dim() == 3 && supers.size(0) == K / 256 && supers.size(1) == 2 && supers.size(2) == N,
                  "an a8-kquant linear's super-block scales must be contiguous float32 [K / 256, 2, N]");
      break;
    case kA8ScaleMin:
      TORCH_CHECK(N % kA8Cols == 0, "output features must be a multiple of 16");
      TORCH_CHECK(highs.device().is_cpu() && highs.is_contiguous() && highs.scalar_type() == at::kByte &&
                      highs.dim() == 2 && highs.size(0) == N && (highs.size(1) == 0 || highs.size(1) == K / 8),
                  "an a8-scale-min linear's fifth bits must be contiguous uint8 [N, K / 8] (Q5_1) or [N, 0]");
      TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == K / kA8Group &&
                      (scales.size(1) == 2 || (scales.size(1) == 1 && highs.size(1) == 0)) && scales.size(2) == N,
                  "an a8-scale-min linear's d and m must be fp16 [K / 32, 2, N] (or its d alone, [K / 32, 1, N], "
                  "with 4-bit codes: Q4_0)");
      break;
    case kInt8:
      TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 1 && scales.size(0) == N,
                  "an int8 linear's scale must be bf16 [N]");
      break;
    case kInt4:
      TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(0) == K / kA8Group &&
                      scales.size(1) == N && scales.size(2) == 2, "scales_and_zeros must be bf16 [K / 32, N, 2]");
      break;
    default:  // kF32 returned above; kOneDnn has its own constructor
      break;
  }
  if (bias.defined()) {
    check_bf16(bias, "bias");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "bias must be [N]");
  }
}

NativeLinear::NativeLinear(std::vector<at::Tensor> pieces_, std::vector<int64_t> bounds_, bool split_,
                           c10::optional<at::Tensor> bias_, int64_t out_features)
    : kind(kOneDnn), bias(bias_.value_or(at::Tensor())), pieces(std::move(pieces_)), bounds(std::move(bounds_)),
      split(split_), N(out_features) {
  TORCH_CHECK(!pieces.empty() && bounds.size() == pieces.size() + 1 && bounds[0] == 0 && (split || pieces.size() == 1),
              "a oneDNN linear needs its pieces and their bounds (one piece unless split)");
  for (size_t i = 0; i < pieces.size(); ++i)
    TORCH_CHECK(bounds[i + 1] > bounds[i] && pieces[i].device().is_cpu() && pieces[i].scalar_type() == at::kBFloat16,
                "pieces must be bf16 CPU weights over ascending bounds");
  K = bounds.back();
  TORCH_CHECK(N > 0, "output features must be positive");
  if (bias.defined()) {
    check_bf16(bias, "bias");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "bias must be [N]");
  }
}

NativeLayer::NativeLayer(c10::optional<at::Tensor> input_norm_, c10::optional<at::Tensor> post_norm_,
                         std::vector<NativeLinear> qkv_, NativeLinear o_, std::vector<NativeLinear> gate_up_,
                         NativeLinear down_, c10::optional<at::Tensor> attn_out_norm_,
                         c10::optional<at::Tensor> mlp_out_norm_, c10::optional<at::Tensor> q_norm_,
                         c10::optional<at::Tensor> k_norm_, int64_t kind_, bool rope_)
    : input_norm(input_norm_.value_or(at::Tensor())), post_norm(post_norm_.value_or(at::Tensor())),
      qkv(std::move(qkv_)), o(std::move(o_)), gate_up(std::move(gate_up_)), down(std::move(down_)),
      attn_out_norm(attn_out_norm_.value_or(at::Tensor())), mlp_out_norm(mlp_out_norm_.value_or(at::Tensor())),
      q_norm(q_norm_.value_or(at::Tensor())), k_norm(k_norm_.value_or(at::Tensor())), kind(kind_), rope(rope_) {
  const at::Tensor* first = nullptr;
  for (const at::Tensor* t : {&input_norm, &post_norm, &attn_out_norm, &mlp_out_norm, &q_norm, &k_norm}) {
    if (!t->defined()) continue;
    check_act(*t, "a norm weight");
    if (first == nullptr) first = t;
    TORCH_CHECK(t->scalar_type() == first->scalar_type(), "a layer's norms share one dtype");
  }
  TORCH_CHECK(input_norm.defined() == post_norm.defined(), "the input norms come together");
  TORCH_CHECK(input_norm.defined() || attn_out_norm.defined(), "a layer norms its inputs, its outputs or both");
  TORCH_CHECK(attn_out_norm.defined() == mlp_out_norm.defined(), "the output norms come together");
  TORCH_CHECK(q_norm.defined() == k_norm.defined(), "the q and k norms come together");
  TORCH_CHECK(kind >= 0, "a layer's kind is an index");
  TORCH_CHECK(!qkv.empty() && !gate_up.empty(), "q/k/v and gate/up need at least one linear each");
}

NativeDecoder::NativeDecoder(std::vector<NativeLayer> layers, at::Tensor norm, NativeLinear head, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, double eps, double scale, bool one_plus, bool gelu,
                             double attn_softcap, double residual_scale, bool wide_rope, int64_t rotary_dim)
    : layers_(std::move(layers)), norm_(std::move(norm)), head_(std::move(head)), H_(heads), KVH_(kv_heads),
      hd_(head_dim), rot_(rotary_dim), eps_(eps), scale_(static_cast<float>(scale)), softcap_(static_cast<float>(attn_softcap)),
      residual_scale_(static_cast<float>(residual_scale)), one_plus_(one_plus), gelu_(gelu), wide_rope_(wide_rope) {
  TORCH_CHECK(rot_ > 0 && rot_ <= hd_ && rot_ % 2 == 0, "the rotary dimension must be even, in (0, head_dim]");
  TORCH_CHECK(softcap_ >= 0.0f && residual_scale_ > 0.0f, "the soft-cap is >= 0 (0: none), the residual scale > 0");
  TORCH_CHECK(!layers_.empty(), "a decoder needs layers");
  TORCH_CHECK(H_ > 0 && KVH_ > 0 && H_ % KVH_ == 0 && hd_ > 0 && hd_ % 2 == 0,
              "heads must be a multiple of kv_heads, head_dim even");
  check_act(norm_, "norm");
  f32_ = norm_.scalar_type() == at::kFloat;
  // every linear's kind fits the activations: float32 ones on float32, the others on bf16
  const auto fits = [&](const NativeLinear& l) { return (l.kind == NativeLinear::kF32) == f32_; };
  D_ = norm_.size(0);
  qkv_width_ = (H_ + 2 * KVH_) * hd_;
  I_ = total_out(layers_[0].gate_up) / 2;
  qk_norms_ = layers_[0].q_norm.defined();
  qk_whole_ = qk_norms_ && layers_[0].q_norm.numel() == H_ * hd_ && hd_ != H_ * hd_;
  kinds_ = 0;
  for (const NativeLayer& l : layers_) {
    TORCH_CHECK(l.input_norm.defined() == layers_[0].input_norm.defined(), "every layer has input norms or none does");
    TORCH_CHECK(!l.input_norm.defined() || (l.input_norm.numel() == D_ && l.post_norm.numel() == D_),
                "norm weights must be [D]");
    const at::Tensor& some_norm = l.input_norm.defined() ? l.input_norm : l.attn_out_norm;
    TORCH_CHECK(some_norm.scalar_type() == norm_.scalar_type(), "every norm shares the final norm's dtype");
    bool all_fit = fits(l.o) && fits(l.down);
    for (const NativeLinear& p : l.qkv) all_fit = all_fit && fits(p);
    for (const NativeLinear& p : l.gate_up) all_fit = all_fit && fits(p);
    TORCH_CHECK(all_fit, "float32 activations take f32 linears only, bfloat16 ones no f32 linear");
    TORCH_CHECK(!l.attn_out_norm.defined() || (l.attn_out_norm.numel() == D_ && l.mlp_out_norm.numel() == D_),
                "output norm weights must be [D]");
    TORCH_CHECK(l.q_norm.defined() == qk_norms_, "every layer has q/k norms or none does");
    TORCH_CHECK(l.attn_out_norm.defined() == layers_[0].attn_out_norm.defined(),
                "every layer has output norms or none does");
    TORCH_CHECK(!qk_norms_ || (qk_whole_ ? l.q_norm.numel() == H_ * hd_ && l.k_norm.numel() == KVH_ * hd_
                                         : l.q_norm.numel() == hd_ && l.k_norm.numel() == hd_),
                "q/k norm weights must be [head_dim] (per head) or [heads * head_dim] / [kv_heads * head_dim] (whole)");
    TORCH_CHECK(total_out(l.qkv) == qkv_width_, "q | k | v must give (heads + 2 kv_heads) * head_dim outputs");
    TORCH_CHECK(total_out(l.gate_up) == 2 * I_, "every layer's gate | up must be 2 * intermediate");
    for (const NativeLinear& p : l.qkv) TORCH_CHECK(p.K == D_, "q/k/v take the hidden size");
    for (const NativeLinear& p : l.gate_up) TORCH_CHECK(p.K == D_, "gate/up take the hidden size");
    TORCH_CHECK(l.o.K == H_ * hd_ && l.o.N == D_, "o maps heads * head_dim to the hidden size");
    TORCH_CHECK(l.down.K == I_ && l.down.N == D_, "down maps the intermediate size to the hidden size");
    kinds_ = std::max(kinds_, l.kind + 1);
  }
  TORCH_CHECK(head_.K == D_, "the head takes the hidden size");
  TORCH_CHECK(fits(head_), "float32 activations take f32 linears only, bfloat16 ones no f32 linear");
}

at::Tensor NativeDecoder::forward(const at::Tensor& hidden, const std::vector<at::Tensor>& cos,
                                  const std::vector<at::Tensor>& sin, const std::vector<int64_t>& bounds,
                                  const std::vector<int64_t>& lengths,
                                  const std::vector<std::vector<at::Tensor>>& keys,
                                  const std::vector<std::vector<at::Tensor>>& values,
                                  const std::vector<std::vector<c10::optional<at::Tensor>>>& offsets,
                                  const std::vector<std::vector<c10::optional<at::Tensor>>>& indices,
                                  const c10::optional<at::Tensor>& keep) const {
  if (f32_) return run<float>(hidden, cos, sin, bounds, lengths, keys, values, offsets, indices, keep);
  return run<bf16>(hidden, cos, sin, bounds, lengths, keys, values, offsets, indices, keep);
}

// x [rows, D'] at unit strides into out: the decoder's norm (triedec's kernel on bf16, transformers'
// own ops on float32)
template <typename T>
void NativeDecoder::norm_rows(const T* x, const at::Tensor& weight, T* out, int64_t rows, int64_t D) const {
  if constexpr (std::is_same_v<T, float>) {
    const at::Tensor y = aten_rms_norm(at::from_blob(const_cast<float*>(x), {rows, D}, at::TensorOptions().dtype(at::kFloat)),
                                       weight, eps_, one_plus_);
    TORCH_CHECK(y.is_contiguous() && y.numel() == rows * D, "the norm returned another shape");
    std::memcpy(out, y.data_ptr<float>(), rows * D * sizeof(float));
  } else {
    kernels().bf16.rms_norm(x, D, weight.data_ptr<T>(), out, rows, D, static_cast<float>(eps_), one_plus_);
  }
}

template <typename T>
at::Tensor NativeDecoder::run(const at::Tensor& hidden, const std::vector<at::Tensor>& cos,
                              const std::vector<at::Tensor>& sin, const std::vector<int64_t>& bounds,
                              const std::vector<int64_t>& lengths, const std::vector<std::vector<at::Tensor>>& keys,
                              const std::vector<std::vector<at::Tensor>>& values,
                              const std::vector<std::vector<c10::optional<at::Tensor>>>& offsets,
                              const std::vector<std::vector<c10::optional<at::Tensor>>>& indices,
                              const c10::optional<at::Tensor>& keep) const {
  const auto check = [](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype_of<T>() && t.is_contiguous(), what,
                " must be a contiguous CPU tensor in the decoder's dtype (its norms')");
  };
  check(hidden, "hidden");
  const int64_t N = hidden.size(0), L = layers();
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == D_, "hidden must be [N, D]");
  TORCH_CHECK(static_cast<int64_t>(cos.size()) == kinds_ && static_cast<int64_t>(sin.size()) == kinds_ &&
                  static_cast<int64_t>(offsets.size()) == kinds_ && static_cast<int64_t>(indices.size()) == kinds_,
              "one rotary table and one set of key lists per kind of layer");
  for (int64_t j = 0; j < kinds_; ++j) {
    if (wide_rope_) {  // OLMo 2's float32 tables
      TORCH_CHECK(cos[j].device().is_cpu() && cos[j].scalar_type() == at::kFloat && cos[j].is_contiguous() &&
                      sin[j].device().is_cpu() && sin[j].scalar_type() == at::kFloat && sin[j].is_contiguous(),
                  "a wide rotary's cos and sin must be contiguous float32 CPU tensors");
    } else {
      check(cos[j], "cos");
      check(sin[j], "sin");
    }
    TORCH_CHECK(cos[j].dim() == 2 && cos[j].size(0) == N && cos[j].size(1) == rot_ && sin[j].sizes() == cos[j].sizes(),
                "cos and sin must be [N, rotary_dim]");
  }
  const size_t items = lengths.size();
  TORCH_CHECK(items > 0 && bounds.size() == items + 1 && keys.size() == items && values.size() == items,
              "one length, keys and values per item");
  for (int64_t j = 0; j < kinds_; ++j)
    TORCH_CHECK(offsets[j].size() == items && indices[j].size() == items, "one key list per item and kind");
  TORCH_CHECK(bounds[0] == 0 && bounds[items] == N, "bounds must run from 0 to N");
  // Each item's caches and key lists, checked once for the whole forward.
  std::vector<int64_t> capacity(items);
  std::vector<std::vector<at::Tensor>> off(kinds_, std::vector<at::Tensor>(items)), idx(off);
  for (size_t k = 0; k < items; ++k) {
    const int64_t count = bounds[k + 1] - bounds[k];
    TORCH_CHECK(count > 0, "every item needs tokens");
    TORCH_CHECK(static_cast<int64_t>(keys[k].size()) == L && static_cast<int64_t>(values[k].size()) == L,
                "one K and V buffer per layer");
    const at::Tensor& first = keys[k][0];
    TORCH_CHECK(first.dim() == 4, "caches must be [1, kv_heads, capacity, head_dim]");
    capacity[k] = first.size(2);
    TORCH_CHECK(lengths[k] >= 0 && lengths[k] + count <= capacity[k], "the new tokens must fit in the cache");
    for (int64_t l = 0; l < L; ++l)
      for (const at::Tensor* buf : {&keys[k][l], &values[k][l]}) {
        check(*buf, "a cache buffer");
        TORCH_CHECK(buf->dim() == 4 && buf->size(0) == 1 && buf->size(1) == KVH_ && buf->size(2) == capacity[k] &&
                        buf->size(3) == hd_, "caches must be [1, kv_heads, capacity, head_dim]");
      }
    const int64_t S = lengths[k] + count;
    for (int64_t j = 0; j < kinds_; ++j) {
      if (!offsets[j][k].has_value() || !offsets[j][k]->defined()) continue;
      TORCH_CHECK(indices[j][k].has_value() && indices[j][k]->defined(), "offsets need indices");
      off[j][k] = offsets[j][k]->to(at::kLong).contiguous();
      idx[j][k] = indices[j][k]->to(at::kInt).contiguous();
      TORCH_CHECK(off[j][k].dim() == 1 && off[j][k].size(0) == count + 1, "offsets must be [T + 1]");
      const int64_t* o = off[j][k].data_ptr<int64_t>();
      const int32_t* ix = idx[j][k].data_ptr<int32_t>();
      TORCH_CHECK(o[0] == 0 && o[count] == idx[j][k].numel(), "offsets must run from 0 to len(indices)");
      for (int64_t t = 0; t < count; ++t) {
        TORCH_CHECK(o[t + 1] > o[t], "every query must see at least one key");
        for (int64_t i = o[t]; i < o[t + 1]; ++i)
          TORCH_CHECK(ix[i] >= 0 && ix[i] < S && (i == o[t] || ix[i] > ix[i - 1]), "indices must ascend within [0, S)");
      }
    }
  }
  at::Tensor rows;
  if (keep.has_value() && keep->defined()) {
    rows = keep->to(at::kLong).contiguous();
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(r[i] >= 0 && r[i] < N, "keep rows must lie in [0, N)");
  }

  const auto opts = hidden.options();
  at::Tensor h = hidden.clone();
  at::Tensor x = at::empty({N, D_}, opts), qkv = at::empty({N, qkv_width_}, opts);
  at::Tensor q = at::empty({H_, N, hd_}, opts), kr = at::empty({KVH_, N, hd_}, opts);
  at::Tensor att = at::empty({N, H_, hd_}, opts), y = at::empty({N, D_}, opts);
  at::Tensor gu = at::empty({N, 2 * I_}, opts), prod = at::empty({N, I_}, opts);
  // Gemma's q / k norms: each head's slice gathered into [N * heads, head_dim], then normed
  at::Tensor gathered, qn, kn;
  if (qk_norms_) {
    gathered = at::empty({N * H_, hd_}, opts);
    qn = at::empty({N * H_, hd_}, opts);
    kn = at::empty({N * KVH_, hd_}, opts);
  }
  at::Tensor y2 = (layers_[0].attn_out_norm.defined()) ? at::empty({N, D_}, opts) : at::Tensor();
  T *hp = h.data_ptr<T>(), *xp = x.data_ptr<T>(), *qkvp = qkv.data_ptr<T>();
  T *qp = q.data_ptr<T>(), *kp = kr.data_ptr<T>(), *ap = att.data_ptr<T>(), *yp = y.data_ptr<T>();
  T *gup = gu.data_ptr<T>(), *pp = prod.data_ptr<T>();
  T* y2p = y2.defined() ? y2.data_ptr<T>() : nullptr;
  const KernelTable& kern = kernels();
  // h += y, a sublayer's output in y, through the layer's norm on that output first where it has
  // one (Gemma 3's post-attention and post-feedforward norms)
  const auto add_output = [&](const at::Tensor& norm) {
    T* out = yp;
    if (norm.defined()) {
      norm_rows<T>(yp, norm, y2p, N, D_);
      out = y2p;
    }
    if (residual_scale_ != 1.0f) scale_rows(out, residual_scale_, N * D_);
    add_rows(hp, out, N * D_);
  };
  // a sublayer's input: the norm of h, or h itself where the layer norms outputs only (OLMo 2)
  const auto sublayer_input = [&](const at::Tensor& norm) -> T* {
    if (!norm.defined()) return hp;
    norm_rows<T>(hp, norm, xp, N, D_);
    return xp;
  };
  const int64_t W = qkv_width_, q_end = H_ * hd_, k_end = (H_ + KVH_) * hd_;
  const int64_t q_strides[3] = {0, hd_, W}, rope_strides[2] = {0, hd_};
  const int64_t qn_strides[3] = {0, hd_, H_ * hd_}, kn_strides[3] = {0, hd_, KVH_ * hd_};

  for (int64_t l = 0; l < L; ++l) {
    const NativeLayer& layer = layers_[l];
    const at::Tensor &ct = cos[layer.kind], &st = sin[layer.kind];
    run_parts(layer.qkv, sublayer_input(layer.input_norm), N, qkvp, W);
    // q [heads, N, head_dim] and k [kv_heads, N, head_dim] from (qs, ks) at strides (q_st, k_st):
    // rotated, or copied as they are on a layer without rotary
    const auto place = [&](const T* qs, const int64_t* q_st, const T* ks, const int64_t* k_st) {
      if (layer.rope && wide_rope_) {
        own_rotary(qs, q_st, ct.data_ptr<float>(), st.data_ptr<float>(), qp, H_, N, hd_, rot_);
        own_rotary(ks, k_st, ct.data_ptr<float>(), st.data_ptr<float>(), kp, KVH_, N, hd_, rot_);
        return;
      }
      if (layer.rope && rot_ != hd_) {
        own_rotary(qs, q_st, ct.data_ptr<T>(), st.data_ptr<T>(), qp, H_, N, hd_, rot_);
        own_rotary(ks, k_st, ct.data_ptr<T>(), st.data_ptr<T>(), kp, KVH_, N, hd_, rot_);
        return;
      }
      if (layer.rope) {
        const T *cp = ct.data_ptr<T>(), *sp = st.data_ptr<T>();
        kern.of<T>().rotary(qs, q_st, cp, rope_strides, sp, rope_strides, qp, 1, H_, N, hd_);
        kern.of<T>().rotary(ks, k_st, cp, rope_strides, sp, rope_strides, kp, 1, KVH_, N, hd_);
        return;
      }
      for (int64_t h = 0; h < H_; ++h)
        for (int64_t r = 0; r < N; ++r)
          std::memcpy(qp + (h * N + r) * hd_, qs + h * q_st[1] + r * q_st[2], hd_ * sizeof(T));
      for (int64_t h = 0; h < KVH_; ++h)
        for (int64_t r = 0; r < N; ++r)
          std::memcpy(kp + (h * N + r) * hd_, ks + h * k_st[1] + r * k_st[2], hd_ * sizeof(T));
    };
    if (qk_norms_) {
      // per head: [N * heads, head_dim] rows; whole (OLMo 2): [N, heads * head_dim] rows, the same memory
      const int64_t qrows = qk_whole_ ? N : N * H_, qwidth = qk_whole_ ? H_ * hd_ : hd_;
      const int64_t krows = qk_whole_ ? N : N * KVH_, kwidth = qk_whole_ ? KVH_ * hd_ : hd_;
      T* gp = gathered.data_ptr<T>();
      for (int64_t r = 0; r < N; ++r) std::memcpy(gp + r * q_end, qkvp + r * W, q_end * sizeof(T));
      norm_rows<T>(gp, layer.q_norm, qn.data_ptr<T>(), qrows, qwidth);
      for (int64_t r = 0; r < N; ++r)
        std::memcpy(gp + r * KVH_ * hd_, qkvp + r * W + q_end, KVH_ * hd_ * sizeof(T));
      norm_rows<T>(gp, layer.k_norm, kn.data_ptr<T>(), krows, kwidth);
      place(qn.data_ptr<T>(), qn_strides, kn.data_ptr<T>(), kn_strides);
    } else {
      place(qkvp, q_strides, qkvp + q_end, q_strides);
    }
    std::vector<AttentionProblem<T>> problems;
    const std::vector<at::Tensor>&koff = off[layer.kind], &kidx = idx[layer.kind];
    for (size_t k = 0; k < items; ++k) {
      const int64_t start = bounds[k], count = bounds[k + 1] - start, len = lengths[k], cap = capacity[k];
      T* kb = keys[k][l].data_ptr<T>();
      T* vb = values[k][l].data_ptr<T>();
      for (int64_t g = 0; g < KVH_; ++g)
        for (int64_t t = 0; t < count; ++t) {
          std::memcpy(kb + (g * cap + len + t) * hd_, kp + (g * N + start + t) * hd_, hd_ * sizeof(T));
          std::memcpy(vb + (g * cap + len + t) * hd_, qkvp + (start + t) * W + k_end + g * hd_, hd_ * sizeof(T));
        }
      const bool listed = koff[k].defined();
      problems.push_back(AttentionProblem<T>{
          qp + start * hd_, N * hd_, hd_, kb, cap * hd_, hd_, vb, cap * hd_, hd_, ap + start * H_ * hd_, count, H_,
          H_ / KVH_, hd_, listed ? koff[k].data_ptr<int64_t>() : nullptr,
          listed ? kidx[k].data_ptr<int32_t>() : nullptr, len + count, scale_, softcap_});
    }
    kern.of<T>().tree_attention(problems);
    run_linear(layer.o, ap, N, yp);
    add_output(layer.attn_out_norm);
    run_parts(layer.gate_up, sublayer_input(layer.post_norm), N, gup, 2 * I_);
    gated_rows(gup, N, I_, gelu_, pp);
    run_linear(layer.down, pp, N, yp);
    add_output(layer.mlp_out_norm);
  }
  // The final norm and the head on the kept rows only (a row's norm is its own).
  const int64_t R = rows.defined() ? rows.numel() : N;
  at::Tensor kept = h;
  if (rows.defined()) {
    kept = at::empty({R, D_}, opts);
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i)
      std::memcpy(kept.data_ptr<T>() + i * D_, hp + r[i] * D_, D_ * sizeof(T));
  }
  at::Tensor normed = at::empty({R, D_}, opts);
  norm_rows<T>(kept.data_ptr<T>(), norm_, normed.data_ptr<T>(), R, D_);
  at::Tensor logits = at::empty({R, head_.N}, opts);
  run_linear(head_, normed.data_ptr<T>(), R, logits.data_ptr<T>());
  return logits;
}

}  // namespace triedec
