// triedec's tree attention on AVX-512 (the avx512vnni build), the leading part of each AVX2
// function of x86/avx2/tree_attention.h, which includes it. Included by tree_attention.cpp inside
// its anonymous namespace.
#pragma once

// The same IEEE operations per element again, 16 lanes at a time. A score's 8 partial sums (d mod
// 8) sit in 8 lanes, so a 16-lane register carries two keys' (lanes 0-7 one key, 8-15 the next)
// against the query's 8 features broadcast to both halves; the partial sums are combined by the
// same additions as the AVX2 path's hadd tree ((0+1)+(2+3))+((4+5)+(6+7)), here on shuffles within
// each 128-bit lane. The weighted values are one chain per feature, 16 features per register. Each
// returns where the AVX2 loop goes on.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load8x2(const float* a, const float* b) {  // lanes 0-7: a[0..8), lanes 8-15: b[0..8)
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m256i halves(const void* a, const void* b) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
}
inline __m512 load8x2(const c10::BFloat16* a, const c10::BFloat16* b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves(a, b)), 16));
}
inline __m512 load8x2(const c10::Half* a, const c10::Half* b) { return _mm512_cvtph_ps(halves(a, b)); }

inline __m512 exp16(__m512 x) {  // exp8 on 16 lanes, the same operations
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kUnderflow), _CMP_GT_OQ);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _mm512_set1_ps(kRound)),
                                 _mm512_set1_ps(kRound));
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}

inline __m512 hadd512(__m512 a, __m512 b) {  // _mm256_hadd_ps's sums in each 128-bit lane
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

template <typename scalar_t, int NQ, bool kStream>
inline int64_t team_scores_pass(const Problem<scalar_t>& P, Output* o, const float* q0, int64_t r, int64_t last) {
  const scalar_t* kbase = P.k + o[0].g * P.k_sh;
  const int64_t D = P.D;
  if (D % kLanes != 0) return r;
  const __m128 scale = _mm_set1_ps(P.scale);
  for (; r + 8 <= last; r += 8) {  // 8 keys: pairs (0,1), (2,3), (4,5), (6,7), one register each
    const scalar_t* kp[8];
    for (int j = 0; j < 8; ++j) kp[j] = kbase + o[0].keys.at(r + j) * P.k_ss;
    if constexpr (kStream)
      for (int j = 0; j < 8; ++j) prefetch_row(kp[j], P.k_ss, P.D);
    __m512 a[NQ][4];
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += kLanes) {
      __m512 qv[NQ];
      for (int i = 0; i < NQ; ++i) qv[i] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q0 + i * D + d));
      for (int j = 0; j < 4; ++j) {
        const __m512 kv = load8x2(kp[2 * j] + d, kp[2 * j + 1] + d);
        for (int i = 0; i < NQ; ++i) a[i][j] = _mm512_fmadd_ps(qv[i], kv, a[i][j]);
      }
    }
    for (int i = 0; i < NQ; ++i) {
      // 128-bit lanes of t: [k0 k2 k4 k6] (partials 0-3), the same (4-7), [k1 k3 k5 k7] (0-3), (4-7)
      const __m512 t = hadd512(hadd512(a[i][0], a[i][1]), hadd512(a[i][2], a[i][3]));
      const __m128 even = _mm_add_ps(_mm512_castps512_ps128(t), _mm512_extractf32x4_ps(t, 1));
      const __m128 odd = _mm_add_ps(_mm512_extractf32x4_ps(t, 2), _mm512_extractf32x4_ps(t, 3));
      _mm_storeu_ps(o[i].scores + r, _mm_mul_ps(_mm_unpacklo_ps(even, odd), scale));
      _mm_storeu_ps(o[i].scores + r + 4, _mm_mul_ps(_mm_unpackhi_ps(even, odd), scale));
    }
  }
  return r;
}

template <typename scalar_t, int NQ, bool kStream>
inline int64_t team_values_pass(const Problem<scalar_t>& P, Output* o, int64_t first, int64_t last) {
  const scalar_t* vbase = P.v + o[0].g * P.v_sh;
  const int64_t D = P.D;
  constexpr int kWide = 16, kRegs = 4;  // 64 features a pass
  int64_t d0 = 0;
  for (; d0 + kRegs * kWide <= D; d0 += kRegs * kWide) {
    __m512 a[NQ][kRegs];
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < kRegs; ++j) a[i][j] = _mm512_loadu_ps(o[i].acc + d0 + j * kWide);
    for (int64_t s = first; s < last; ++s) {
      const scalar_t* vp = vbase + o[0].keys.at(s) * P.v_ss + d0;
      if constexpr (kStream)
        if (d0 == 0) prefetch_row(vp, P.v_ss, P.D);
      __m512 e[NQ];
      for (int i = 0; i < NQ; ++i) e[i] = _mm512_set1_ps(o[i].scores[s]);
      for (int j = 0; j < kRegs; ++j) {
        const __m512 vv = load16(vp + j * kWide);
        for (int i = 0; i < NQ; ++i) a[i][j] = _mm512_fmadd_ps(e[i], vv, a[i][j]);
      }
    }
    for (int i = 0; i < NQ; ++i)
      for (int j = 0; j < kRegs; ++j) _mm512_storeu_ps(o[i].acc + d0 + j * kWide, a[i][j]);
  }
  return d0;
}

// exp_avx2's leading part: 16 scores a pass, exp8's operations on each; the 8 chains of the
// denominator (rank mod 8) take the low 8 lanes, then the high 8, so each still adds in rank order.
// Returns where exp_avx2 goes on.
inline int64_t exp_avx512(Output& o, int64_t n, float best, __m256& tv) {
  int64_t r = 0;
  const __m512 top16 = _mm512_set1_ps(best);
  for (; r + 16 <= n; r += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(o.scores + r), top16));
    _mm512_storeu_ps(o.scores + r, e);
    tv = _mm256_add_ps(tv, _mm512_castps512_ps256(e));
    tv = _mm256_add_ps(tv, _mm512_extractf32x8_ps(e, 1));
  }
  return r;
}

// With the K and V rows prefetched ahead where the problem has one query (see
// x86/avx2/tree_attention.h's prefetch_row), without it elsewhere.
template <typename scalar_t, int NQ>
inline int64_t team_scores_avx512(const Problem<scalar_t>& P, Output* o, const float* q0, int64_t r, int64_t last) {
  return P.T == 1 ? team_scores_pass<scalar_t, NQ, true>(P, o, q0, r, last)
                  : team_scores_pass<scalar_t, NQ, false>(P, o, q0, r, last);
}

template <typename scalar_t, int NQ>
inline int64_t team_values_avx512(const Problem<scalar_t>& P, Output* o, int64_t first, int64_t last) {
  return P.T == 1 ? team_values_pass<scalar_t, NQ, true>(P, o, first, last)
                  : team_values_pass<scalar_t, NQ, false>(P, o, first, last);
}
