// triedec's 8-bit linears on AVX2 (the avx2 build) and on 256-bit vpdpbusd (the avxvnni and
// avxvnni_evex builds, TRIEDEC_DPBUSD256): the activations' quantization and the register tiles of
// every layout (see a8_linears.cpp for the layouts and the contract). Included by a8_linears.cpp
// inside its anonymous namespace where TRIEDEC_A8_AVX2 is defined; the same IEEE operations per
// element as the portable path there, so the same bits.
#pragma once

// The same operations on AVX2, 8 features a register (the portable path calls libm's fminf and
// fmaxf for each feature: a quarter of a small linear's time on AVX2).
inline __m256 bf16_to_float8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline int32_t sum_lanes(const __m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

void quantize_group_vector(const c10::BFloat16* xg, int8_t* q, float* a, float* aq, int32_t* sum, int32_t* half) {
  __m256 x[4];
  for (int i = 0; i < 4; ++i) x[i] = bf16_to_float8(xg + 8 * i);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 most = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1])),
                                    _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  if (!(top > kTiny)) {
    std::memset(q, 0, kGroup);
    *a = 0.0f;
    *aq = 0.0f;
    *sum = half[0] = half[1] = 0;
    return;
  }
  const __m256 inv = _mm256_set1_ps(127.0f / top);
  const __m256 limit = _mm256_set1_ps(127.0f), floor = _mm256_set1_ps(-127.0f);
  __m256i v[4];  // clamped as floats before the conversion (max_ps returns its second operand for a NaN first)
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x[i], inv), floor), limit));
  // packs work per 128-bit lane: bytes come out as dwords v0[0..3] v1[0..3] v2[0..3] v3[0..3], then
  // the same of [4..7]; the permutation puts each register's 8 back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  half[0] = sum_lanes(_mm256_add_epi32(v[0], v[1]));
  half[1] = sum_lanes(_mm256_add_epi32(v[2], v[3]));
  const int32_t total = half[0] + half[1];
  *a = top / 127.0f;
  *aq = *a * static_cast<float>(total);
  *sum = total;
}

// AVX2 has no vpdpbusd. Its stand-in, vpmaddubsw (unsigned byte x signed byte, adjacent pairs
// summed to int16 with saturation) then vpmaddwd by ones (pairs of int16 summed to int32), is
// exact here because no int16 sum can saturate: int4 codes are 0..15 and activations -127..127, so
// a pair is at most 2 * 15 * 127 = 3810 and a group's eight pairs per lane, added in int16, at most
// 30480; int8 codes are taken as signed (the packed byte xor 128) and multiplied as |q| by x with
// q's sign (vpsignb), a pair at most 2 * 127 * 127 = 32258, each widened to int32 before the next.
// So D is the same integer as on the other paths, and the float operations per output are the
// same ones in the same order. A 16-output vector is two halves of 8 (one 256-bit register each).

// int8_linear's float steps on AVX2 for group g and vector v of a tile (int5_linear's too): y in
// y_out = fma(a D, s, y), per half of 8 outputs.
// (int6_linear's with its float32 super-block scales of the vector in place of s: scales_f32.)
template <int R, int V>
inline void int8_steps_avx2(const __m256i (&acc)[R][2], const c10::Half* scales, int64_t g, int64_t nvb, int v,
                            const RowTile& x, float* y_out, const float* scales_f32 = nullptr) {
  for (int h = 0; h < 2; ++h) {
    const __m256 scale = scales_f32 ? _mm256_loadu_ps(scales_f32 + 8 * h) : _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + (g * nvb + v) * kCols + 8 * h)));
    for (int r = 0; r < R; ++r) {
      float* y = y_out + (r * V + v) * kCols + 8 * h;
      const __m256 aD = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(x.a[r][g]));
      _mm256_storeu_ps(y, _mm256_fmadd_ps(aD, scale, _mm256_loadu_ps(y)));
    }
  }
}

inline __m256 half_to_float8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// int4_linear's tile on AVX2: rows r < R and vectors 0..V - 1 of a block (V = nvb); per group, per
// vector, the group's 4 steps of 64 bytes (one 1 KiB window of the block's stream at a time). AVX2
// has 16 registers, too few for every y of the tile beside the sums: y stays in y_out (L1), read
// and written once per group.
// With S = c10::Half, scale_min_linear's 4-bit tile: the file's fp16 d and m (kMins; else m = -8 d)
// in place of s and c.
template <int R, int V, class S = c10::BFloat16, bool kMins = true, bool kAhead>
inline void tile4_avx2_pass(const uint8_t* codes, const S* sz, int64_t nvb, int64_t K,
                            const RowTile& x, float* y_out) {
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int i = 0; i < R * V * kCols; ++i) y_out[i] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) {
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int m = 0; m < kSteps; ++m) {
        const uint8_t* at = codes + ((g * kSteps + m) * nvb + v) * 64;
        if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
          lo[h] = _mm256_and_si256(bytes, low);                          // features 8m..8m+3
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);    // features 8m+4..8m+7
        }
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = _mm256_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m]);
          const __m256i x1 = _mm256_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m + 1]);
          for (int h = 0; h < 2; ++h) {
#ifdef TRIEDEC_DPBUSD256
            acc[r][h] = TRIEDEC_DPBUSD256(acc[r][h], lo[h], x0);  // int32 sums of 4 products
            acc[r][h] = TRIEDEC_DPBUSD256(acc[r][h], hi[h], x1);
#else
            acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(lo[h], x0));
            acc[r][h] = _mm256_add_epi16(acc[r][h], _mm256_maddubs_epi16(hi[h], x1));
            // the sum stays in its register, step by step: without this GCC reassociated the adds
            // (exact in any order), kept every product of the group on the stack and summed them
            // at its end, 10-18% slower at 4-64 rows (AVX2 EPYC, 2 threads)
            asm("" : "+x"(acc[r][h]));
#endif
          }
        }
      }
      constexpr int kPer = kMins ? 2 : 1;
      const S* at = sz + (g * kPer * nvb + v) * kCols;
      for (int h = 0; h < 2; ++h) {
        __m256 scale, constant;
        if constexpr (std::is_same_v<S, c10::Half>) {
          scale = half_to_float8(at + 8 * h);
          constant = kMins ? half_to_float8(at + nvb * kCols + 8 * h) : _mm256_mul_ps(scale, _mm256_set1_ps(-8.0f));
        } else {
          scale = bf16_to_float8(at + 8 * h);
          constant = _mm256_fmadd_ps(_mm256_set1_ps(-8.0f), scale, bf16_to_float8(at + nvb * kCols + 8 * h));
        }
        for (int r = 0; r < R; ++r) {
          float* y = y_out + (r * V + v) * kCols + 8 * h;
#ifdef TRIEDEC_DPBUSD256
          const __m256i D = acc[r][h];
#else
          const __m256i D = _mm256_madd_epi16(acc[r][h], ones);
#endif
          const __m256 aD = _mm256_mul_ps(_mm256_cvtepi32_ps(D), _mm256_set1_ps(x.a[r][g]));
          __m256 sum = _mm256_fmadd_ps(aD, scale, _mm256_loadu_ps(y));
          sum = _mm256_fmadd_ps(_mm256_set1_ps(x.aq[r][g]), constant, sum);
          _mm256_storeu_ps(y, sum);
        }
      }
    }
  }
}

// tile4_avx2_pass with the codes prefetched ahead where the tile streams its block
// (x.ahead), without where it reads them from the caches: two instantiations, no test in
// the loop.
template <int R, int V, class S = c10::BFloat16, bool kMins = true>
inline void tile4_avx2(const uint8_t* codes, const S* sz, int64_t nvb, int64_t K,
                       const RowTile& x, float* y_out) {
  if (x.ahead) tile4_avx2_pass<R, V, S, kMins, true>(codes, sz, nvb, K, x, y_out);
  else tile4_avx2_pass<R, V, S, kMins, false>(codes, sz, nvb, K, x, y_out);
}

// int8_linear's tile on AVX2: as tile4_avx2, the group's 8 steps of 4 features per vector.
template <int R, int V, bool kAhead>
inline void tile8_avx2_pass(const uint8_t* codes, const c10::Half* scales, int64_t nvb, int64_t K,
                            const RowTile& x, float* y_out) {
  const int64_t G = K / kGroup;
  constexpr int kQuads = kGroup / 4;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  for (int i = 0; i < R * V * kCols; ++i) y_out[i] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) {
      __m256i acc[R][2];
#ifdef TRIEDEC_DPBUSD256
      // as tile8: from -128 Q, the codes + 128 as unsigned bytes by the activations
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_set1_epi32(-128 * x.sum[r][g]);
      for (int m = 0; m < kQuads; ++m) {
        const uint8_t* at = codes + ((g * kQuads + m) * nvb + v) * 64;
        if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
        __m256i w[2];
        for (int h = 0; h < 2; ++h) w[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
        for (int r = 0; r < R; ++r) {
          const __m256i xb = _mm256_set1_epi32(x.xq[r][g * kQuads + m]);
          for (int h = 0; h < 2; ++h) acc[r][h] = TRIEDEC_DPBUSD256(acc[r][h], w[h], xb);
        }
      }
#else
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
      for (int m = 0; m < kQuads; ++m) {
        const uint8_t* at = codes + ((g * kQuads + m) * nvb + v) * 64;
        if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
        __m256i w[2], magnitude[2];
        for (int h = 0; h < 2; ++h) {
          w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h)), flip);  // q
          magnitude[h] = _mm256_abs_epi8(w[h]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i xb = _mm256_set1_epi32(x.xq[r][g * kQuads + m]);
          for (int h = 0; h < 2; ++h) {
            const __m256i pairs = _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(xb, w[h]));
            acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
#endif
      int8_steps_avx2<R, V>(acc, scales, g, nvb, v, x, y_out);
    }
  }
}

// tile8_avx2_pass with the codes prefetched ahead where the tile streams its block
// (x.ahead), without where it reads them from the caches: two instantiations, no test in
// the loop.
template <int R, int V>
inline void tile8_avx2(const uint8_t* codes, const c10::Half* scales, int64_t nvb, int64_t K,
                       const RowTile& x, float* y_out) {
  if (x.ahead) tile8_avx2_pass<R, V, true>(codes, scales, nvb, K, x, y_out);
  else tile8_avx2_pass<R, V, false>(codes, scales, nvb, K, x, y_out);
}

// 32 bits of a mask as 32 bytes: 0x10 where the bit is set (byte k: bit k).
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// The AVX2 tiles of the codes in int4's layout read as unsigned 0..31 (int5, kquant): tile4_avx2's
// unpacking, with the fifth bits (fifth_bits) where kFifth, each group's sums from kBias * Q; then
// finish(acc, g, v) takes the float steps of group g and vector v. Without AVX-VNNI each step's
// pairs (at most 2 * 31 * 127 = 7874) are widened to int32 before the next.
template <int R, int V, bool kFifth, int kBias, class Finish, bool kAhead>
inline void tile_nibbles_avx2_pass(const uint8_t* codes, const uint8_t* highs, int64_t nvb, int64_t K,
                                   const RowTile& x, float* y_out, Finish&& finish) {
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F);
#ifndef TRIEDEC_DPBUSD256
  const __m256i ones = _mm256_set1_epi16(1);
#endif
  for (int i = 0; i < R * V * kCols; ++i) y_out[i] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) {
      __m256i acc[R][2];
      for (int r = 0; r < R; ++r)
        acc[r][0] = acc[r][1] = kBias ? _mm256_set1_epi32(kBias * x.sum[r][g]) : _mm256_setzero_si256();
      for (int m = 0; m < kSteps; ++m) {
        const int64_t step = (g * kSteps + m) * nvb + v;
        const uint8_t* at = codes + step * 64;
        if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
        uint32_t masks[4] = {};  // low nibbles' bits of outputs 0-7, 8-15, then the high nibbles'
        if constexpr (kFifth) std::memcpy(masks, highs + step * 16, 16);
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
          lo[h] = _mm256_and_si256(bytes, low);
          hi[h] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
          if constexpr (kFifth) {
            lo[h] = _mm256_or_si256(lo[h], fifth_bits(masks[h]));
            hi[h] = _mm256_or_si256(hi[h], fifth_bits(masks[2 + h]));
          }
        }
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = _mm256_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m]);
          const __m256i x1 = _mm256_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m + 1]);
          for (int h = 0; h < 2; ++h) {
#ifdef TRIEDEC_DPBUSD256
            acc[r][h] = TRIEDEC_DPBUSD256(acc[r][h], lo[h], x0);
            acc[r][h] = TRIEDEC_DPBUSD256(acc[r][h], hi[h], x1);
#else
            acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(lo[h], x0), ones));
            acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(hi[h], x1), ones));
#endif
          }
        }
      }
      finish(acc, g, v);
    }
  }
}

// tile_nibbles_avx2_pass with the codes prefetched ahead where the tile streams its block
// (x.ahead), without where it reads them from the caches: two instantiations, no test in
// the loop.
template <int R, int V, bool kFifth, int kBias, class Finish>
inline void tile_nibbles_avx2(const uint8_t* codes, const uint8_t* highs, int64_t nvb, int64_t K, const RowTile& x,
                              float* y_out, Finish&& finish) {
  if (x.ahead) tile_nibbles_avx2_pass<R, V, kFifth, kBias, Finish, true>(codes, highs, nvb, K, x, y_out,
                                                                         std::forward<Finish>(finish));
  else tile_nibbles_avx2_pass<R, V, kFifth, kBias, Finish, false>(codes, highs, nvb, K, x, y_out,
                                                                  std::forward<Finish>(finish));
}

// int5_linear's tile on AVX2: tile_nibbles_avx2 with the fifth bits from -16 Q, tile8_avx2's float steps.
template <int R, int V>
inline void tile5_avx2(const uint8_t* codes, const uint8_t* highs, const c10::Half* scales, int64_t nvb, int64_t K,
                       const RowTile& x, float* y_out) {
  tile_nibbles_avx2<R, V, true, -16>(codes, highs, nvb, K, x, y_out,
                                [&](const __m256i (&acc)[R][2], int64_t g, int v) {
                                  int8_steps_avx2<R, V>(acc, scales, g, nvb, v, x, y_out);
                                });
}

// scale_min_linear's tile on AVX2: 4-bit codes on tile4_avx2 (its sums in int16), 5-bit ones (Q5_1:
// a group's int16 sums could exceed 32767) on tile_nibbles_avx2 from 0, both with tile_sm's steps.
template <int R, int V, bool kFifth, bool kMins>
inline void tile_sm_avx2(const uint8_t* codes, const uint8_t* highs, const c10::Half* dm, int64_t nvb, int64_t K,
                         const RowTile& x, float* y_out) {
  static_assert(kMins || !kFifth, "5-bit codes come with their minimums (Q5_1)");
  if constexpr (!kFifth) {
    tile4_avx2<R, V, c10::Half, kMins>(codes, dm, nvb, K, x, y_out);
  } else {
    tile_nibbles_avx2<R, V, true, 0>(codes, highs, nvb, K, x, y_out, [&](const __m256i (&acc)[R][2], int64_t g, int v) {
      const c10::Half* at = dm + (g * 2 * nvb + v) * kCols;
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = half_to_float8(at + 8 * h), mins = half_to_float8(at + nvb * kCols + 8 * h);
        for (int r = 0; r < R; ++r) {
          float* y = y_out + (r * V + v) * kCols + 8 * h;
          const __m256 aD = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(x.a[r][g]));
          __m256 sum = _mm256_fmadd_ps(aD, scale, _mm256_loadu_ps(y));
          sum = _mm256_fmadd_ps(_mm256_set1_ps(x.aq[r][g]), mins, sum);
          _mm256_storeu_ps(y, sum);
        }
      }
    });
  }
}

// kquant_linear's tile on AVX2: tile_nibbles_avx2 from 0, then tilek's steps per half of 8 outputs.
template <int R, int V, bool kFifth>
inline void tilek_avx2(const uint8_t* codes, const uint8_t* highs, const int8_t* scales_mins, const float* supers,
                       int64_t nvb, int64_t K, const RowTile& x, float* y_out) {
  tile_nibbles_avx2<R, V, kFifth, 0>(codes, highs, nvb, K, x, y_out, [&](const __m256i (&acc)[R][2], int64_t g, int v) {
    const int8_t* sm = scales_mins + (g * 2 * nvb + v) * kCols;
    const float* de = supers + ((g / 8) * 2 * nvb + v) * kCols;
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8 * h)));
      const __m256i mn = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + nvb * kCols + 8 * h)));
      const __m256 d = _mm256_loadu_ps(de + 8 * h), e = _mm256_loadu_ps(de + nvb * kCols + 8 * h);
      for (int r = 0; r < R; ++r) {
        float* y = y_out + (r * V + v) * kCols + 8 * h;
        const __m256 a = _mm256_set1_ps(x.a[r][g]);
        const __m256i J = _mm256_mullo_epi32(_mm256_set1_epi32(x.sum[r][g]), mn);
        __m256 sum = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(acc[r][h], sc)), a), d,
                                     _mm256_loadu_ps(y));
        sum = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(J), a), e, sum);
        _mm256_storeu_ps(y, sum);
      }
    }
  });
}
// int6_linear's tile on AVX2: tile4_avx2's unpacking with bits 4 and 5 from the step's 32 bytes of
// top bits (one shift and mask for each of its four registers of codes), then tile8_avx2's float
// steps on the super-block's d. Without AVX-VNNI, S is folded into vpmaddwd: each 32-bit lane of
// vpmaddubsw's output holds output i's two pairs (at most 2 * 63 * 127 = 16002 each, no
// saturation), and vpmaddwd by (S, S) in that lane gives S (p0 + p1) in int32 (at most 4.1e6), so
// the sum starts from -32 (S_0 Q_0 + S_1 Q_1) (vpmaddwd of (S_0, S_1) by (Q_0, Q_1), |Q_h| <= 2032)
// and adds each step's S_h-weighted sums: I, the same integer. With AVX-VNNI, vpdpbusd sums into
// int32 directly: each half's sum from -32 Q_h, times S_h (vpmulld), the two added.
template <int R, int V, bool kAhead>
inline void tile6_avx2_pass(const uint8_t* codes, const uint8_t* highs, const int8_t* subs, const float* supers,
                            int64_t nvb, int64_t K, const RowTile& x, float* y_out) {
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
#ifndef TRIEDEC_DPBUSD256
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
#endif
  for (int i = 0; i < R * V * kCols; ++i) y_out[i] = 0.0f;
  for (int64_t g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) {
      __m256i scale[2][2];  // [half group][half of the outputs]: S as int32
      for (int half = 0; half < 2; ++half)
        for (int h = 0; h < 2; ++h)
          scale[half][h] = _mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(subs + ((2 * g + half) * nvb + v) * kCols + 8 * h)));
      __m256i total[R][2], acc[R][2];
#ifndef TRIEDEC_DPBUSD256
      __m256i pair[2][2];  // (S_h, S_h) in each lane's two int16
      for (int half = 0; half < 2; ++half)
        for (int h = 0; h < 2; ++h)
          pair[half][h] = _mm256_or_si256(_mm256_and_si256(scale[half][h], low16), _mm256_slli_epi32(scale[half][h], 16));
      for (int h = 0; h < 2; ++h) {
        const __m256i both = _mm256_or_si256(_mm256_and_si256(scale[0][h], low16), _mm256_slli_epi32(scale[1][h], 16));
        for (int r = 0; r < R; ++r) {
          const int32_t q01 = (x.half[r][2 * g] & 0xFFFF) | static_cast<int32_t>(static_cast<uint32_t>(x.half[r][2 * g + 1]) << 16);
          const __m256i corr = _mm256_madd_epi16(both, _mm256_set1_epi32(q01));  // S_0 Q_0 + S_1 Q_1
          acc[r][h] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5));
        }
      }
#endif
      for (int m = 0; m < kSteps; ++m) {
        const int half = m / 2;
#ifdef TRIEDEC_DPBUSD256
        if (m % 2 == 0)
          for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_set1_epi32(-32 * x.half[r][2 * g + half]);
#endif
        const int64_t step = (g * kSteps + m) * nvb + v;
        const uint8_t* at = codes + step * 64;
        if constexpr (kAhead) _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
        const __m256i tops = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(highs + step * 32));
        const __m256i top_lo[2] = {_mm256_and_si256(_mm256_slli_epi16(tops, 4), top),
                                   _mm256_and_si256(_mm256_slli_epi16(tops, 2), top)};
        const __m256i top_hi[2] = {_mm256_and_si256(tops, top), _mm256_and_si256(_mm256_srli_epi16(tops, 2), top)};
        __m256i lo[2], hi[2];
        for (int h = 0; h < 2; ++h) {
          const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
          lo[h] = _mm256_or_si256(_mm256_and_si256(bytes, low), top_lo[h]);
          hi[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), top_hi[h]);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i x0 = _mm256_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m]);
          const __m256i x1 = _mm256_set1_epi32(x.xq[r][g * 2 * kSteps + 2 * m + 1]);
          for (int h = 0; h < 2; ++h) {
#ifdef TRIEDEC_DPBUSD256
            acc[r][h] = TRIEDEC_DPBUSD256(acc[r][h], lo[h], x0);
            acc[r][h] = TRIEDEC_DPBUSD256(acc[r][h], hi[h], x1);
#else
            acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(lo[h], x0), pair[half][h]));
            acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(hi[h], x1), pair[half][h]));
#endif
          }
        }
#ifdef TRIEDEC_DPBUSD256
        if (m % 2 == 1)
          for (int r = 0; r < R; ++r)
            for (int h = 0; h < 2; ++h) {
              const __m256i part = _mm256_mullo_epi32(acc[r][h], scale[half][h]);
              total[r][h] = half == 0 ? part : _mm256_add_epi32(total[r][h], part);
            }
#endif
      }
#ifndef TRIEDEC_DPBUSD256
      for (int r = 0; r < R; ++r) total[r][0] = acc[r][0], total[r][1] = acc[r][1];
#endif
      int8_steps_avx2<R, V>(total, nullptr, g, nvb, v, x, y_out, supers + ((g / 8) * nvb + v) * kCols);
    }
  }
}

// tile6_avx2_pass with the codes prefetched ahead where the tile streams its block
// (x.ahead), without where it reads them from the caches: two instantiations, no test in
// the loop.
template <int R, int V>
inline void tile6_avx2(const uint8_t* codes, const uint8_t* highs, const int8_t* subs, const float* supers,
                       int64_t nvb, int64_t K, const RowTile& x, float* y_out) {
  if (x.ahead) tile6_avx2_pass<R, V, true>(codes, highs, subs, supers, nvb, K, x, y_out);
  else tile6_avx2_pass<R, V, false>(codes, highs, subs, supers, nvb, K, x, y_out);
}

