// triedec's 8-bit linears on AVX512-VNNI (the avx512vnni build): the activations' quantization
// and the register tiles of every layout (see a8_linears.cpp for the layouts and the contract).
// Included by a8_linears.cpp inside its anonymous namespace where TRIEDEC_VNNI is defined; the same
// IEEE operations per element as the portable path there, so the same bits.
#pragma once

void quantize_group_vector(const c10::BFloat16* xg, int8_t* q, float* a, float* aq, int32_t* sum, int32_t* half) {
  const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg))), 16));
  const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16))), 16));
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  if (!(top > kTiny)) {
    std::memset(q, 0, kGroup);
    *a = 0.0f;
    *aq = 0.0f;
    *sum = half[0] = half[1] = 0;
    return;
  }
  const __m512 inv = _mm512_set1_ps(127.0f / top);
  const __m512 limit = _mm512_set1_ps(127.0f), floor = _mm512_set1_ps(-127.0f);
  // clamped as floats before the conversion (max_ps returns its second operand for a NaN first)
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(lo, inv), floor), limit));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(hi, inv), floor), limit));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qhi));
  half[0] = _mm512_reduce_add_epi32(qlo);
  half[1] = _mm512_reduce_add_epi32(qhi);
  const int32_t total = half[0] + half[1];
  *a = top / 127.0f;
  *aq = *a * static_cast<float>(total);
  *sum = total;
}

// out[0..15] = y rounded to bf16 as c10::BFloat16 rounds a float (nearest even on the bits; any
// NaN to 0x7FC0), so the same bits as the scalar conversion (vcvtneps2bf16 would flush subnormals).
inline void store_bf16(c10::BFloat16* out, __m512 y) {
  const __m512i u = _mm512_castps_si512(y);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(rounded));
}

inline __m512 bf16_to_float(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// int8_linear's float steps for group g of a tile (int5_linear's too): y = fma(a D, s, y), s the
// group's fp16 scales of each vector.
// (int6_linear's with its float32 super-block scales in place of s: scales_f32.)
template <int R, int V>
inline void int8_steps(const __m512i (&acc)[R][V], const c10::Half* scales, int64_t g, int64_t nvb,
                       const RowTile& x, __m512 (&y)[R][V], const float* scales_f32 = nullptr) {
  for (int v = 0; v < V; ++v) {
    const __m512 scale = scales_f32 ? _mm512_loadu_ps(scales_f32 + v * kCols) : _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (g * nvb + v) * kCols)));
    for (int r = 0; r < R; ++r) {
      const __m512 aD = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][v]), _mm512_set1_ps(x.a[r][g]));
      y[r][v] = _mm512_fmadd_ps(aD, scale, y[r][v]);
    }
  }
}

// The tiles of the codes in int4's layout (int4, int5, kquant): rows r < R and vectors 0..V - 1 of a
// block (V = nvb), over every group in order: D by vpdpbusd over the group's 32 features (codes as
// unsigned bytes, unpacked from the packed weight as they are used, with each code's fifth bit from
// int5's plane (a masked byte of 16) where kFifth; activations as signed bytes), from kBias * Q; then
// finish(acc, g, y) takes the group's float steps, y staying in registers from the first group to
// the last.
template <int R, int V, bool kFifth, int kBias, class Finish, bool kAhead>
inline void tile_nibbles_pass(const uint8_t* codes, const uint8_t* highs, int64_t nvb, int64_t K,
                              const RowTile& x, float* y_out, Finish&& finish) {
  const int64_t G = K / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  __m512 y[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R][V];
    for (int r = 0; r < R; ++r) {
      const __m512i offset = kBias ? _mm512_set1_epi32(kBias * x.sum[r][g]) : _mm512_setzero_si512();
      for (int v = 0; v < V; ++v) acc[r][v] = offset;
    }
    for (int m = 0; m < kSteps; ++m) {
      __m512i lo[V], hi[V];
      for (int v = 0; v < V; ++v) {
        const int64_t step = (g * kSteps + m) * nvb + v;
        if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(codes + step * 64 + kAheadBytes), _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512(codes + step * 64);
        lo[v] = _mm512_and_si512(bytes, low);                            // features 8m..8m+3
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);      // features 8m+4..8m+7
        if constexpr (kFifth) {
          uint64_t masks[2];
          std::memcpy(masks, highs + step * 16, 16);
          lo[v] = _mm512_or_si512(lo[v], _mm512_maskz_mov_epi8(masks[0], fifth));
          hi[v] = _mm512_or_si512(hi[v], _mm512_maskz_mov_epi8(masks[1], fifth));
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i x0 = _mm512_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m]);
        const __m512i x1 = _mm512_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m + 1]);
        for (int v = 0; v < V; ++v) {
          acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], lo[v], x0);
          acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], hi[v], x1);
        }
      }
    }
    finish(acc, g, y);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y_out + (r * V + v) * kCols, y[r][v]);
}

// tile_nibbles_pass with the codes prefetched ahead where the tile streams its block
// (x.ahead), without where it reads them from the caches: two instantiations, no test in
// the loop.
template <int R, int V, bool kFifth, int kBias, class Finish>
inline void tile_nibbles(const uint8_t* codes, const uint8_t* highs, int64_t nvb, int64_t K, const RowTile& x,
                         float* y_out, Finish&& finish) {
  if (x.ahead) tile_nibbles_pass<R, V, kFifth, kBias, Finish, true>(codes, highs, nvb, K, x, y_out,
                                                                    std::forward<Finish>(finish));
  else tile_nibbles_pass<R, V, kFifth, kBias, Finish, false>(codes, highs, nvb, K, x, y_out,
                                                             std::forward<Finish>(finish));
}

// int4_linear's tile: tile_nibbles from 0, then y = fma(a D, s, y); y = fma(a Q, c, y).
template <int R, int V>
inline void tile4(const uint8_t* codes, const c10::BFloat16* sz, int64_t nvb, int64_t K,
                  const RowTile& x, float* y_out) {
  tile_nibbles<R, V, false, 0>(codes, nullptr, nvb, K, x, y_out, [&](const __m512i (&acc)[R][V], int64_t g,
                                                                     __m512 (&y)[R][V]) {
    for (int v = 0; v < V; ++v) {
      const c10::BFloat16* at = sz + (g * 2 * nvb + v) * kCols;
      const __m512 scale = bf16_to_float(at);
      const __m512 constant = _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), scale, bf16_to_float(at + nvb * kCols));
      for (int r = 0; r < R; ++r) {
        const __m512 aD = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][v]), _mm512_set1_ps(x.a[r][g]));
        y[r][v] = _mm512_fmadd_ps(aD, scale, y[r][v]);
        y[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(x.aq[r][g]), constant, y[r][v]);
      }
    }
  });
}

// scale_min_linear's tile: tile_nibbles from 0 (the fifth bits where kFifth: Q5_1), then tile4's
// steps with the file's fp16 d and m (kMins; else m = -8 d: Q4_0) in place of s and c.
template <int R, int V, bool kFifth, bool kMins>
inline void tile_sm(const uint8_t* codes, const uint8_t* highs, const c10::Half* dm, int64_t nvb, int64_t K,
                    const RowTile& x, float* y_out) {
  constexpr int kPer = kMins ? 2 : 1;
  tile_nibbles<R, V, kFifth, 0>(codes, highs, nvb, K, x, y_out, [&](const __m512i (&acc)[R][V], int64_t g,
                                                                    __m512 (&y)[R][V]) {
    for (int v = 0; v < V; ++v) {
      const c10::Half* at = dm + (g * kPer * nvb + v) * kCols;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      const __m512 mins = kMins ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + nvb * kCols)))
                                : _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
      for (int r = 0; r < R; ++r) {
        const __m512 aD = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][v]), _mm512_set1_ps(x.a[r][g]));
        y[r][v] = _mm512_fmadd_ps(aD, scale, y[r][v]);
        y[r][v] = _mm512_fmadd_ps(_mm512_set1_ps(x.aq[r][g]), mins, y[r][v]);
      }
    }
  });
}

// int8_linear's tile: rows r < R and vectors 0..V - 1 of a block (V = nvb), over every group in
// order: D by vpdpbusd (codes + 128 as unsigned bytes) from -128 Q, then y = fma(a D, s, y).
template <int R, int V, bool kAhead>
inline void tile8_pass(const uint8_t* codes, const c10::Half* scales, int64_t nvb, int64_t K,
                       const RowTile& x, float* y_out) {
  const int64_t G = K / kGroup;
  constexpr int kQuads = kGroup / 4;
  __m512 y[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[R][V];  // starting from -128 Q, so it ends at D = sum_k x'_k (q_k + 128) - 128 Q
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(-128 * x.sum[r][g]);
      for (int v = 0; v < V; ++v) acc[r][v] = offset;
    }
    for (int m = 0; m < kQuads; ++m) {
      __m512i w[V];
      for (int v = 0; v < V; ++v) {
        const uint8_t* at = codes + ((g * kQuads + m) * nvb + v) * 64;
        if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
        w[v] = _mm512_loadu_si512(at);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xb = _mm512_set1_epi32(x.xq[r][g * kQuads + m]);
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], w[v], xb);
      }
    }
    int8_steps<R, V>(acc, scales, g, nvb, x, y);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y_out + (r * V + v) * kCols, y[r][v]);
}

// tile8_pass with the codes prefetched ahead where the tile streams its block
// (x.ahead), without where it reads them from the caches: two instantiations, no test in
// the loop.
template <int R, int V>
inline void tile8(const uint8_t* codes, const c10::Half* scales, int64_t nvb, int64_t K,
                  const RowTile& x, float* y_out) {
  if (x.ahead) tile8_pass<R, V, true>(codes, scales, nvb, K, x, y_out);
  else tile8_pass<R, V, false>(codes, scales, nvb, K, x, y_out);
}

// int5_linear's tile: tile_nibbles with the fifth bits from -16 Q, then int8's float steps.
template <int R, int V>
inline void tile5(const uint8_t* codes, const uint8_t* highs, const c10::Half* scales, int64_t nvb, int64_t K,
                  const RowTile& x, float* y_out) {
  tile_nibbles<R, V, true, -16>(codes, highs, nvb, K, x, y_out, [&](const __m512i (&acc)[R][V], int64_t g,
                                                                    __m512 (&y)[R][V]) {
    int8_steps<R, V>(acc, scales, g, nvb, x, y);
  });
}

// kquant_linear's tile: tile_nibbles from 0 (the fifth bits where kFifth: Q5_K), then per vector
// I = sc D and J = m Q (vpmulld), y = fma(a I, d, y); y = fma(a J, e, y).
template <int R, int V, bool kFifth>
inline void tilek(const uint8_t* codes, const uint8_t* highs, const int8_t* scales_mins, const float* supers,
                  int64_t nvb, int64_t K, const RowTile& x, float* y_out) {
  tile_nibbles<R, V, kFifth, 0>(codes, highs, nvb, K, x, y_out, [&](const __m512i (&acc)[R][V], int64_t g,
                                                                    __m512 (&y)[R][V]) {
    for (int v = 0; v < V; ++v) {
      const int8_t* sm = scales_mins + (g * 2 * nvb + v) * kCols;
      const float* de = supers + ((g / 8) * 2 * nvb + v) * kCols;
      const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm)));
      const __m512i mn = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + nvb * kCols)));
      const __m512 d = _mm512_loadu_ps(de), e = _mm512_loadu_ps(de + nvb * kCols);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x.a[r][g]);
        const __m512i J = _mm512_mullo_epi32(_mm512_set1_epi32(x.sum[r][g]), mn);
        y[r][v] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_mullo_epi32(acc[r][v], sc)), a), d, y[r][v]);
        y[r][v] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(J), a), e, y[r][v]);
      }
    }
  });
}

// int6_linear's tile: tile4's unpacking with bits 4 and 5 from the step's 32 bytes of top bits
// (broadcast to both halves, each half shifted to its two bits by a 64-bit lane shift), each half group's sum
// from -32 Q_h times its S (vpmulld), the two added, then int8's float steps on the super-block's d.
template <int R, int V, bool kAhead>
inline void tile6_pass(const uint8_t* codes, const uint8_t* highs, const int8_t* subs, const float* supers, int64_t nvb,
                       int64_t K, const RowTile& x, float* y_out) {
  const int64_t G = K / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  // bytes 0-31 of a register take bits 0-1 (low nibbles) or 4-5 (high) of the top bytes, bytes 32-63
  // bits 2-3 or 6-7: shifted to bits 4-5 (a bit shifted in from a neighbouring byte is masked off)
  const __m512i lo_shift = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4), hi_shift = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
  __m512 y[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i total[R][V];
    for (int h = 0; h < 2; ++h) {
      __m512i acc[R][V];  // from -32 Q_h: it ends at D_h = sum_k x'_k (q_k + 32) - 32 Q_h
      for (int r = 0; r < R; ++r) {
        const __m512i offset = _mm512_set1_epi32(-32 * x.half[r][2 * g + h]);
        for (int v = 0; v < V; ++v) acc[r][v] = offset;
      }
      for (int m = 2 * h; m < 2 * h + 2; ++m) {
        __m512i lo[V], hi[V];
        for (int v = 0; v < V; ++v) {
          const int64_t step = (g * kSteps + m) * nvb + v;
          if constexpr (kAhead)
            _mm_prefetch(reinterpret_cast<const char*>(codes + step * 64 + kAheadBytes), _MM_HINT_T0);
          const __m512i bytes = _mm512_loadu_si512(codes + step * 64);
          const __m512i tops = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(highs + step * 32)));
          lo[v] = _mm512_or_si512(_mm512_and_si512(bytes, low), _mm512_and_si512(_mm512_sllv_epi64(tops, lo_shift), top));
          hi[v] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low),
                                  _mm512_and_si512(_mm512_srlv_epi64(tops, hi_shift), top));
        }
        for (int r = 0; r < R; ++r) {
          const __m512i x0 = _mm512_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m]);
          const __m512i x1 = _mm512_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m + 1]);
          for (int v = 0; v < V; ++v) {
            acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], lo[v], x0);
            acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], hi[v], x1);
          }
        }
      }
      for (int v = 0; v < V; ++v) {
        const __m512i scale = _mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(subs + ((2 * g + h) * nvb + v) * kCols)));
        for (int r = 0; r < R; ++r) {
          const __m512i part = _mm512_mullo_epi32(acc[r][v], scale);
          total[r][v] = h == 0 ? part : _mm512_add_epi32(total[r][v], part);
        }
      }
    }
    int8_steps<R, V>(total, nullptr, g, nvb, x, y, supers + (g / 8) * nvb * kCols);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(y_out + (r * V + v) * kCols, y[r][v]);
}

// tile6_pass with the codes prefetched ahead where the tile streams its block
// (x.ahead), without where it reads them from the caches: two instantiations, no test in
// the loop.
template <int R, int V>
inline void tile6(const uint8_t* codes, const uint8_t* highs, const int8_t* subs, const float* supers, int64_t nvb,
                  int64_t K, const RowTile& x, float* y_out) {
  if (x.ahead) tile6_pass<R, V, true>(codes, highs, subs, supers, nvb, K, x, y_out);
  else tile6_pass<R, V, false>(codes, highs, subs, supers, nvb, K, x, y_out);
}

