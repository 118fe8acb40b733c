// The extension's operations on tensors (ops.cpp; bound to Python in bindings.cpp): each checks its
// inputs, allocates its output and runs a kernel of kernels.h on the dtype it was given.
#pragma once

#include <torch/types.h>

#include <vector>

// query [H, T, D], keys / values [KVH, S, D]; see tree_attention.cpp.
torch::Tensor tree_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                             c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> indices,
                             double scale, double softcap);
torch::Tensor tree_attention_items(torch::Tensor query, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                                   std::vector<int64_t> bounds, std::vector<c10::optional<torch::Tensor>> offsets,
                                   std::vector<c10::optional<torch::Tensor>> indices, double scale, double softcap);

// x [..., D] (last dimension contiguous), weight [D]; see rms_norm.cpp.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool one_plus_weight);

// x [B, H, T, D], cos / sin [B, T, D]; transformers' rotate-half rotary, the same bits (rotary.cpp).
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// x [R, K] bf16, quantized weights packed as a8_linears.cpp says, 8-bit activations in the dot
// products. `portable` forces the portable path (the tests compare the two).
bool a8_linears_vectorized();
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, bool portable);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, bool portable);
torch::Tensor int5_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor scales,
                          bool portable);
torch::Tensor int6_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor subs,
                          torch::Tensor supers, bool portable);

// x [R, K] float32, the weight packed as f32_linears.cpp says: each output summed in input order.
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias);
// The probes of probes.cpp: multiply-adds done by `iterations` rounds on each thread; a checksum of
// a contiguous uint8 tensor's bytes, read once.
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor scales_mins,
                            torch::Tensor supers, bool portable);
torch::Tensor scale_min_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor dm,
                               bool portable);
int64_t dot_peak(int64_t iterations);
int64_t stream_read(torch::Tensor bytes);
