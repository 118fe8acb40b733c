// A kernel library's one export: its table of kernels (kernel_table.h).
#include "kernel_table.h"

#ifndef TRIEDEC_ISA
#define TRIEDEC_ISA "native"
#endif

namespace {

using namespace triedec;

template <typename T>
constexpr TypedKernels<T> typed() {
  return TypedKernels<T>{&tree_attention_run<T>, &rms_norm_rows<T>, &rotary_rows<T>};
}

const KernelTable table{kKernelTableVersion, TRIEDEC_ISA, TRIEDEC_SOURCES_DIGEST, typed<float>(),
                        typed<c10::BFloat16>(), typed<c10::Half>(), &a8_linears_vectorized, &int4_linear_rows,
                        &int8_linear_rows, &f32_linear_rows, &add_bf16, &mul_bf16_rows, &add_bias_bf16,
                        &int5_linear_rows, &int6_linear_rows, &kquant_linear_rows, &scale_min_linear_rows, &dot_peak, &stream_read};

}  // namespace

extern "C" __attribute__((visibility("default"))) const triedec::KernelTable* triedec_kernel_table() {
  return &table;
}
