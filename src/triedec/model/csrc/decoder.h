// triedec's native forward of a Llama-family or Gemma 3 decoder (decoder.cpp; bound in bindings.cpp, driven by
// triedec/model/runner.py): one call runs every layer over a batch of items (each its own tokens,
// its own KV cache and the key slots each token sees), calling the kernels of kernels.h in the
// order transformers' modeling file calls its modules, with no Python between them.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace triedec {

// transformers' RMS norm in float32, as its own torch ops compute it (LlamaRMSNorm, Qwen2RMSNorm:
// w * (x * rsqrt(mean(x^2) + eps)); one_plus, Gemma3RMSNorm: (x * rsqrt(mean(x^2) + eps)) * (1 + w)).
at::Tensor aten_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool one_plus);

// One linear, by kind: "f32", triedec's float32 linear (f32_linears.cpp: packed float32 [N, K], N a
// multiple of 16, no scales, bias float32 [N] or undefined; on float32 activations); on triedec's
// 8-bit-activation kernels (a8_linears.cpp), "a8-int4" (4-bit codes
// packed uint8 [N, K / 2], scales_zeros bf16 [K / 32, 2, N]) or "a8-int8" (8-bit codes packed uint8
// [N, K], scales fp16 [K / 32, N]); or on torch's weight-only ops on bf16 activations, the int8 and
// int4 modes' own (triedec/model/precision.py): "int8" (_weight_int8pack_mm: codes int8 [N, K],
// scale bf16 [N]) or "int4" (_weight_int4pack_mm_for_cpu: codes as torch packs them, [N, K / 2]
// uint8, scales_and_zeros bf16 [K / 32, N, 2]). in_features: K. bias: bf16 [N] or undefined.
// Or "onednn" (the second constructor): oneDNN's pre-packed linear, torch's mkldnn::_linear_pointwise
// as triedec's PackedLinear calls it (the bias inside the op), or over consecutive pieces of the
// input features as SplitLinear runs it (split: each piece's output added in order, then the bias);
// pieces: the packed weights, bounds: where each piece starts, then in_features.
struct NativeLinear {
  enum Kind { kA8Int4, kA8Int8, kA8Int5, kA8Int6, kA8KQuant, kA8ScaleMin, kInt8, kInt4, kOneDnn, kF32 };
  // highs: a8-int5's plane of fifth bits ([N, K / 8]) or a8-int6's two planes of bits 4 and 5 ([N, K
  // / 4]); a8-int6 (a Q6_K layer: 4-bit codes as a8-int4's, scales int8 [K / 16, N]) also takes
  // supers, float32 [K / 256, N]; a8-kquant (a Q4_K or Q5_K layer: 4-bit codes as a8-int4's, highs as
  // a8-int5's for Q5_K or [N, 0] for Q4_K, scales int8 [K / 32, 2, N]) takes supers float32 [K / 256,
  // 2, N]; a8-scale-min (a Q4_0, Q4_1 or Q5_1 layer: 4-bit codes as a8-int4's, highs as a8-int5's for
  // Q5_1 or [N, 0], scales fp16 d and m [K / 32, 2, N], or Q4_0's d alone [K / 32, 1, N]) takes highs
  // only; both undefined for every other kind
  NativeLinear(const std::string& kind, at::Tensor packed, c10::optional<at::Tensor> scales,
               c10::optional<at::Tensor> bias, int64_t in_features, c10::optional<at::Tensor> highs,
               c10::optional<at::Tensor> supers);
  NativeLinear(std::vector<at::Tensor> pieces, std::vector<int64_t> bounds, bool split, c10::optional<at::Tensor> bias,
               int64_t out_features);
  Kind kind;
  at::Tensor packed, scales, bias, highs, supers;
  std::vector<at::Tensor> pieces;
  std::vector<int64_t> bounds;
  bool split = false;
  int64_t K, N;
};

// One decoder layer: its two RMS norms' weights ([D] bf16 or float32, the activations' dtype: before
// attention, before the MLP), the
// linears whose outputs side by side are q | k | v and gate | up (one joined linear each, or the
// parts), the output and down linears; Gemma 3's norms where it has them (undefined elsewhere): on
// the attention's and the MLP's outputs ([D]) and on each head's q and k ([head_dim]; OLMo 2's
// over the whole projection: [heads * head_dim] and [kv_heads * head_dim]); kind: which
// rotary table and key lists its attention uses (Gemma 3's sliding-window and full layers).
struct NativeLayer {
  NativeLayer(c10::optional<at::Tensor> input_norm, c10::optional<at::Tensor> post_norm,
              std::vector<NativeLinear> qkv, NativeLinear o, std::vector<NativeLinear> gate_up, NativeLinear down,
              c10::optional<at::Tensor> attn_out_norm, c10::optional<at::Tensor> mlp_out_norm,
              c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, int64_t kind, bool rope);
  at::Tensor input_norm, post_norm;  // undefined: none (OLMo 2 norms the sublayers' outputs only)
  std::vector<NativeLinear> qkv;
  NativeLinear o;
  std::vector<NativeLinear> gate_up;
  NativeLinear down;
  at::Tensor attn_out_norm, mlp_out_norm, q_norm, k_norm;
  int64_t kind;
  bool rope;  // false: q and k go to attention unrotated (SmolLM3's layers without rotary)
};

class NativeDecoder {
 public:
  // heads, kv_heads and head_dim of the attention; eps of every RMS norm; one_plus: every norm is
  // y = round(x * r * (1 + w)) (Gemma) rather than y = w * round(x * r); gelu: the MLP's activation
  // is torch's tanh-approximated gelu (Gemma) rather than silu; scale: the attention's score scale;
  // norm: the final norm's weight; head: the LM head. The norms' dtype is the activations': bfloat16
  // (every linear of a bf16 kind, the norms triedec's kernel) or float32 (every linear "f32", the
  // norms transformers' own ops, aten_rms_norm).
  // attn_softcap: scores become c * tanh(score / c) (Gemma 2; 0: none); residual_scale: a sublayer's
  // output is scaled, one rounded product per element, before the residual add (Granite's
  // residual multiplier; 1: none); wide_rope: the rotary tables are float32 and each rotated
  // element is rounded once from float32 (OLMo 2's rotary), else the tables are in the activations'
  // dtype and each product is rounded (transformers' Llama rotary); rotary_dim: the features of a
  // head rotated, the first ones (Phi-4-mini's partial rotary; head_dim: all), the rest kept.
  NativeDecoder(std::vector<NativeLayer> layers, at::Tensor norm, NativeLinear head, int64_t heads,
                int64_t kv_heads, int64_t head_dim, double eps, double scale, bool one_plus, bool gelu,
                double attn_softcap, double residual_scale, bool wide_rope, int64_t rotary_dim);

  // hidden [N, D] in the activations' dtype (as cos, sin, the caches and the logits): the embedded tokens of every item, item k's rows bounds[k] .. bounds[k+1);
  // cos[j] / sin[j] [N, head_dim] bf16: the rotary embedding of layers of kind j at each row's
  // position. Item k's cache: lengths[k] committed slots in keys[k][layer] / values[k][layer]
  // ([1, KVH, capacity, head_dim] bf16, contiguous), its new K/V written after them; the slots its
  // token t sees in layers of kind j: indices[j][k][offsets[j][k][t] .. offsets[j][k][t+1])
  // (undefined: every slot). keep: the rows whose logits to return (int64; undefined: all).
  // Returns the logits [rows, vocab].
  at::Tensor forward(const at::Tensor& hidden, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                     const std::vector<int64_t>& bounds, const std::vector<int64_t>& lengths,
                     const std::vector<std::vector<at::Tensor>>& keys,
                     const std::vector<std::vector<at::Tensor>>& values,
                     const std::vector<std::vector<c10::optional<at::Tensor>>>& offsets,
                     const std::vector<std::vector<c10::optional<at::Tensor>>>& indices,
                     const c10::optional<at::Tensor>& keep) const;

  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  template <typename T>
  at::Tensor run(const at::Tensor& hidden, const std::vector<at::Tensor>& cos, const std::vector<at::Tensor>& sin,
                 const std::vector<int64_t>& bounds, const std::vector<int64_t>& lengths,
                 const std::vector<std::vector<at::Tensor>>& keys, const std::vector<std::vector<at::Tensor>>& values,
                 const std::vector<std::vector<c10::optional<at::Tensor>>>& offsets,
                 const std::vector<std::vector<c10::optional<at::Tensor>>>& indices,
                 const c10::optional<at::Tensor>& keep) const;
  template <typename T>
  void norm_rows(const T* x, const at::Tensor& weight, T* out, int64_t rows, int64_t D) const;

  std::vector<NativeLayer> layers_;
  at::Tensor norm_;
  NativeLinear head_;
  int64_t H_, KVH_, hd_, D_, I_, qkv_width_, kinds_, rot_;
  double eps_;
  float scale_, softcap_, residual_scale_;
  bool one_plus_, gelu_, wide_rope_, qk_norms_, qk_whole_, f32_;
};

}  // namespace triedec
