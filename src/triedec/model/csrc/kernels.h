// The kernels' own interface: plain pointers, strides and sizes, no torch. The kernel files are
// compiled once per instruction set, each into a library of its own (triedec/model/isa.py), so they
// include only what is light: c10's header-only 16-bit float types and ATen's parallel_for. The
// extension (ops.cpp, decoder.cpp, bindings.cpp: checking tensors, allocating outputs, choosing the
// dtype) is compiled once, for every CPU, and calls the kernels only through the table of the
// library loaded at run time (kernel_table.h), never by these names.
// Each kernel computes every output row in an order fixed by that row alone, so a row gets the
// same bits whatever else the call carries.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace triedec {

// tree_attention.cpp: one item's queries and the keys / values they see (see that file).
// q [H, T, D] at strides (q_sh, q_st); k and v [KVH, S, D] at (k_sh, k_ss), (v_sh, v_ss); out
// [T, H, D] contiguous; group = H / KVH; the keys query t sees: indices[offsets[t] ..
// offsets[t + 1]) (ascending), or every slot when offsets is null.
template <typename scalar_t>
struct AttentionProblem {
  const scalar_t* q; int64_t q_sh, q_st;
  const scalar_t* k; int64_t k_sh, k_ss;
  const scalar_t* v; int64_t v_sh, v_ss;
  scalar_t* out; int64_t T, H, group, D;
  const int64_t* offsets; const int32_t* indices; int64_t S;
  float scale, softcap;
};
// Every problem's outputs in one parallel loop, each exactly as in a call of its own.
template <typename scalar_t>
void tree_attention_run(const std::vector<AttentionProblem<scalar_t>>& problems);

// rms_norm.cpp: rows of D features at row_stride (unit feature stride), weight [D], out [rows, D].
template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, int64_t row_stride, const scalar_t* w, scalar_t* out, int64_t rows, int64_t D,
                   float eps, bool one_plus);

// rotary.cpp: x [B, H, T, D] at x_strides[0..3) (unit last stride), cos and sin [B, T, D] at their
// strides[0..2) (unit last stride), out [B, H, T, D] contiguous; D even.
template <typename scalar_t>
void rotary_rows(const scalar_t* x, const int64_t* x_strides, const scalar_t* cos, const int64_t* cos_strides,
                 const scalar_t* sin, const int64_t* sin_strides, scalar_t* out, int64_t B, int64_t H, int64_t T,
                 int64_t D);

// a8_linears.cpp: x [R, K] bf16 contiguous, out [R, N] bf16 contiguous, the packed weights in that
// file's block order; `portable` forces the portable path (the tests compare the two).
constexpr int64_t kA8Group = 32;  // input features per group
constexpr int64_t kA8Cols = 16;   // outputs per vector (N is a multiple)
bool a8_linears_vectorized();
void int4_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed,
                      const c10::BFloat16* scales_zeros, int64_t N, c10::BFloat16* out, bool portable);
void int8_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const c10::Half* scales,
                      int64_t N, c10::BFloat16* out, bool portable);
// int5: int4's layout of the low 4 bits and a plane of the fifth bits (a8_linears.cpp), int8's scales
void int5_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                      const c10::Half* scales, int64_t N, c10::BFloat16* out, bool portable);
// int6 (a Q6_K block's codes): int4's layout of the low 4 bits, two planes of bits 4 and 5, int8
// scales per half group of 16 (subs) and float32 ones per super-block of 256 (supers); K % 256 == 0
void int6_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                      const int8_t* subs, const float* supers, int64_t N, c10::BFloat16* out, bool portable);
// kquant (a Q4_K or Q5_K block's codes, scales and mins): int4's layout of the low 4 bits, int5's
// plane of fifth bits (highs; null for Q4_K), int8 scales and mins per group of 32 (scales_mins
// [K / 32, 2, N]) and float32 d and -dmin per super-block of 256 (supers [K / 256, 2, N]); K % 256 == 0
void kquant_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                        const int8_t* scales_mins, const float* supers, int64_t N, c10::BFloat16* out, bool portable);
// scale_min (a Q4_0, Q4_1 or Q5_1 block's codes, d and m): int4's layout of the low 4 bits, int5's
// plane of fifth bits (highs; null for 4-bit codes), fp16 d and m per group in int4's order of
// scales and zeros (dm [K / 32, 2, N]), or where !mins (Q4_0, 4-bit codes) d alone in int8's order
// of scales (dm [K / 32, 1, N]) and m = -8 d
void scale_min_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                           const c10::Half* dm, bool mins, int64_t N, c10::BFloat16* out, bool portable);

// f32_linears.cpp: x [R, K] float32 contiguous, packed [N, K] float32 in that file's block order (N
// a multiple of 16), bias [N] or null, out [R, N] float32 contiguous; each output summed over the
// input features in order, one fused multiply-add each, then the bias added.
void f32_linear_rows(const float* x, int64_t R, int64_t K, const float* packed, const float* bias, int64_t N,
                     float* out);

// elementwise.cpp: the native forward's elementwise steps on bfloat16, each one float32 operation
// per element rounded to bfloat16 (torch's bfloat16 add and mul): h[i] += y[i] over n elements;
// out[r, i] = a[r, i] * b[r, i] for R rows of n at row strides a_ld and b_ld (out contiguous);
// out[r, n] += bias[n] for R rows of N.
void add_bf16(c10::BFloat16* h, const c10::BFloat16* y, int64_t n);
void mul_bf16_rows(const c10::BFloat16* a, int64_t a_ld, const c10::BFloat16* b, int64_t b_ld, c10::BFloat16* out,
                   int64_t R, int64_t n);
void add_bias_bf16(c10::BFloat16* out, const c10::BFloat16* bias, int64_t R, int64_t N);

// probes.cpp: the machine's limits, measured (scripts/roofline.py). dot_peak runs `iterations`
// rounds of 12 chains of this build's 8-bit dot product on each of torch's threads and returns
// the multiply-adds done; stream_read reads bytes [0, n) once over the threads and returns a
// checksum.
int64_t dot_peak(int64_t iterations);
int64_t stream_read(const uint8_t* bytes, int64_t n);

}  // namespace triedec
