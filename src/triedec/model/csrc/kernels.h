// What triedec's extension exports (bound to Python in bindings.cpp). Each kernel computes every
// output row in an order fixed by that row alone, so a row gets the same bits whatever else the
// call carries.
#pragma once

// torch/types.h (torch::Tensor, the factories, ATen) and not torch/extension.h, which adds
// pybind11 and the whole C++ frontend: only bindings.cpp needs those, and the kernels compile in
// about a third of the time.
#include <torch/types.h>

#include <vector>

// tree_attention.cpp: query [H, T, D], keys / values [KVH, S, D]; see that file.
torch::Tensor tree_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                             c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> indices,
                             double scale, double softcap);
torch::Tensor tree_attention_items(torch::Tensor query, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                                   std::vector<int64_t> bounds, std::vector<c10::optional<torch::Tensor>> offsets,
                                   std::vector<c10::optional<torch::Tensor>> indices, double scale, double softcap);

// rms_norm.cpp: x [..., D] (last dimension contiguous), weight [D]; see that file.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool one_plus_weight);

// rotary.cpp: x [B, H, T, D], cos / sin [B, T, D]; transformers' rotate-half rotary, the same bits.
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// a8_linears.cpp: x [R, K] bf16, quantized weights packed as that file says, 8-bit activations in
// the dot products; see that file. `portable` forces the portable path (the tests compare the two).
bool a8_linears_vectorized();
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, bool portable);
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, bool portable);
