// Linear layers in float32 (the float mode's, triedec/model/linears.py's F32Linear packs the weights
// and calls this). One token's forward of a float32 model reads its weights once at one row, so
// the layer is bound by how fast its weights stream from memory; oneDNN's pre-packed GEMM streamed
// the default model's at ~19 GB/s a forward where this machine reads ~35 (docs/kernels.md).
//
// The sum: output n of row r is, over the input features in order,
//   y = fma(x[r, k], w[n, k], y)    for k = 0 .. K - 1, from y = 0
// then y + b[n] where the layer has a bias: one IEEE operation each, in an order fixed by the
// output alone, so a row gets the same bits alone or in any call, on any thread count, and the
// AVX-512, AVX2 (x86/avx512/f32_linears.h, x86/avx2/f32_linears.h) and portable paths give the same
// bits (each lane of a vector is one output).
//
// Packed layout (triedec.model.linears.pack_f32): float32, N * K values in blocks of 4 vectors of 16
// outputs (64 outputs; the last block may hold fewer, nvb): block b, feature k, vector v of the
// block: 16 values at b * 4 * K * 16 + (k * nvb + v) * 16, holding w[16 (4 b + v) + i, k] for
// i = 0 .. 15: one sequential stream per block, read in that order.
#include "kernels.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define TRIEDEC_F32_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TRIEDEC_F32_AVX2 1
#endif

namespace {

constexpr int kCols = 16;   // outputs per vector
constexpr int kBlock = 4;   // vectors per block (one stream per block)
constexpr int64_t kAhead = 1024;  // floats of the block's stream prefetched ahead (4 KiB)

#if defined(TRIEDEC_F32_AVX512)
#include "x86/avx512/f32_linears.h"
#elif defined(TRIEDEC_F32_AVX2)
#include "x86/avx2/f32_linears.h"
#else
constexpr int kRows = 1;

// One tile: rows r < R (row r at x[r * ldx]) and vectors v < V of a block's stream w (nvb vectors
// per feature), y [R, V * 16] written in float32.
template <int R, int V>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t nvb, int64_t K, float* y) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V * kCols; ++i) y[r * V * kCols + i] = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float* at = w + k * nvb * kCols;
    for (int r = 0; r < R; ++r) {
      const float xk = x[r * ldx + k];
      for (int i = 0; i < V * kCols; ++i) y[r * V * kCols + i] = std::fma(xk, at[i], y[r * V * kCols + i]);
    }
  }
}
#endif

}  // namespace

namespace triedec {

// tiles.h's loop: blocks of 64 outputs in register tiles of up to kRows rows, the rows and blocks
// cut as for the 8-bit linears. Each output is computed whole by one tile in the same operations
// whatever the tile, part or thread count.
void f32_linear_rows(const float* x, int64_t R, int64_t K, const float* packed, const float* bias, int64_t N,
                     float* out) {
  if (R == 0) return;
  const int64_t NV = N / kCols;
  for_each_row_tile(R, kRows, (NV + kBlock - 1) / kBlock, [&](int64_t b, int64_t r0, int rows, bool) {
    alignas(64) float y[kRows * kBlock * kCols];
    const int64_t nvb = std::min<int64_t>(kBlock, NV - b * kBlock), first = b * kBlock * kCols;
    dispatch_tile<kRows>(rows, static_cast<int>(nvb), [&](auto tr, auto tv) {
      tile<decltype(tr)::value, decltype(tv)::value>(x + r0 * K, K, packed + b * kBlock * K * kCols, nvb, K, y);
    });
    const int64_t width = nvb * kCols;
    for (int r = 0; r < rows; ++r) {
      float* o = out + (r0 + r) * N + first;
      const float* yr = y + r * width;
      if (bias != nullptr)
        for (int64_t i = 0; i < width; ++i) o[i] = yr[i] + bias[first + i];
      else
        for (int64_t i = 0; i < width; ++i) o[i] = yr[i];
    }
  });
}

}  // namespace triedec
