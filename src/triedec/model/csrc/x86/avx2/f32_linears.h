// triedec's float32 linear on AVX2 (f32_linears.cpp's contract): the register tile. Included by
// f32_linears.cpp inside its anonymous namespace.
#pragma once

constexpr int kRows = 1;    // 16 registers: 1 row x 4 vectors is 8 accumulators of 8 lanes

// One tile: rows r < R (row r at x[r * ldx]) and vectors v < V of a block's stream w (nvb vectors
// per feature), y [R, V * 16] written in float32.
template <int R, int V>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t nvb, int64_t K, float* y) {
  __m256 acc[R][V][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v][0] = acc[r][v][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* at = w + k * nvb * kCols;
    _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < V; ++v)
        for (int h = 0; h < 2; ++h)
          acc[r][v][h] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(at + v * kCols + 8 * h), acc[r][v][h]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (r * V + v) * kCols + 8 * h, acc[r][v][h]);
}
