// triedec's float32 linear on AVX-512 (f32_linears.cpp's contract): the register tile. Included
// by f32_linears.cpp inside its anonymous namespace.
#pragma once

constexpr int kRows = 4;    // rows per register tile: 4 rows x 4 vectors, 16 accumulators of 32 registers

// One tile: rows r < R (row r at x[r * ldx]) and vectors v < V of a block's stream w (nvb vectors
// per feature), y [R, V * 16] written in float32.
template <int R, int V>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t nvb, int64_t K, float* y) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* at = w + k * nvb * kCols;
    _mm_prefetch(reinterpret_cast<const char*>(at + kAhead), _MM_HINT_T0);
    __m512 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_ps(at + v * kCols);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y + (r * V + v) * kCols, acc[r][v]);
}
