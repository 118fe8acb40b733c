// The seam between the extension and the kernel libraries. Each library (the kernel files compiled
// for one instruction set, triedec/model/isa.py) exports one C function, triedec_kernel_table(),
// which returns its KernelTable: its ISA, the digest of the sources it was built from and a pointer
// to each kernel of kernels.h. The extension, compiled once for every CPU, loads the library of the
// fastest ISA this CPU runs (use_kernels, from triedec/model/native.py) and calls the kernels only
// through kernels(). Every library computes the same bits (docs/kernels.md), so the choice decides
// the speed only.
#pragma once

#include "kernels.h"

#include <string>
#include <type_traits>

// The digest of the sources a build was made from (triedec.model.isa.sources_digest; setup.py and
// the first-use build define it): the extension loads only a library of the same digest.
#ifndef TRIEDEC_SOURCES_DIGEST
#define TRIEDEC_SOURCES_DIGEST ""
#endif

namespace triedec {

constexpr int kKernelTableVersion = 7;  // raised whenever KernelTable's layout changes

// One float type's kernels.
template <typename T>
struct TypedKernels {
  void (*tree_attention)(const std::vector<AttentionProblem<T>>&);
  void (*rms_norm)(const T*, int64_t, const T*, T*, int64_t, int64_t, float, bool);
  void (*rotary)(const T*, const int64_t*, const T*, const int64_t*, const T*, const int64_t*, T*, int64_t, int64_t,
                 int64_t, int64_t);
};

struct KernelTable {
  int version;         // kKernelTableVersion of the library's build
  const char* isa;     // the instruction set it was built for
  const char* digest;  // triedec.model.isa.sources_digest() of its sources
  TypedKernels<float> f32;
  TypedKernels<c10::BFloat16> bf16;
  TypedKernels<c10::Half> f16;
  bool (*a8_linears_vectorized)();
  void (*int4_linear_rows)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const c10::BFloat16*, int64_t,
                           c10::BFloat16*, bool);
  void (*int8_linear_rows)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const c10::Half*, int64_t,
                           c10::BFloat16*, bool);
  void (*f32_linear_rows)(const float*, int64_t, int64_t, const float*, const float*, int64_t, float*);
  void (*add_bf16)(c10::BFloat16*, const c10::BFloat16*, int64_t);
  void (*mul_bf16_rows)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, c10::BFloat16*, int64_t,
                        int64_t);
  void (*add_bias_bf16)(c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t);
  void (*int5_linear_rows)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const uint8_t*, const c10::Half*,
                           int64_t, c10::BFloat16*, bool);
  void (*int6_linear_rows)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const uint8_t*, const int8_t*,
                           const float*, int64_t, c10::BFloat16*, bool);
  void (*kquant_linear_rows)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const uint8_t*, const int8_t*,
                             const float*, int64_t, c10::BFloat16*, bool);
  void (*scale_min_linear_rows)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const uint8_t*,
                                const c10::Half*, bool, int64_t, c10::BFloat16*, bool);
  int64_t (*dot_peak)(int64_t);
  int64_t (*stream_read)(const uint8_t*, int64_t);

  template <typename T>
  const TypedKernels<T>& of() const {
    if constexpr (std::is_same_v<T, float>) return f32;
    else if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16;
    else return f16;
  }
};

// In the extension (ops.cpp): the table in use (an error when no library is loaded yet), and
// loading one: the library at `path`, checked against the extension's own sources' digest; from
// then on every call runs its kernels. Returns its ISA.
const KernelTable& kernels();
std::string use_kernels(const std::string& path);

}  // namespace triedec

// In each kernel library (table.cpp).
extern "C" const triedec::KernelTable* triedec_kernel_table();
