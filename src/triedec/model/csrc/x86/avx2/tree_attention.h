// triedec's tree attention on AVX2 (every x86 build but the portable one). Included by
// tree_attention.cpp inside its anonymous namespace.
#pragma once

// Each function below vectorises the leading part of one loop of tree_attention.cpp's portable code
// (the same IEEE operations on every element) and returns where that scalar loop goes on.

// A problem of one query (a decoding request) reads its K and V rows once each, from memory, so
// its loops prefetch the rows kAheadRows slots ahead of those they read (the *_pass functions'
// kStream): a key's slots mostly follow each other, a prefetch of a row that is not read (or lies
// past the cache) costs a load and never faults, and the hardware's prefetcher does not cross a
// 4 KiB page, which holds 32 bf16 rows of 64 features. Several queries (a tree, a prompt chunk)
// read each chunk of rows again from the caches, where a prefetch only costs (0.87-0.89x on a
// chunk's attention on AVX-512).
constexpr int64_t kAheadRows = 16;
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t stride, int64_t D) {  // the row kAheadRows strides on
  const uintptr_t at = reinterpret_cast<uintptr_t>(row) + kAheadRows * stride * sizeof(scalar_t);
  for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(scalar_t)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at + b), _MM_HINT_T0);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 exp8(__m256 x) {  // exp_scalar on 8 lanes, the same operations
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(kUnderflow), _CMP_GT_OQ);
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _mm256_set1_ps(kRound)),
                                 _mm256_set1_ps(kRound));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), keep);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include "../avx512/tree_attention.h"
#else
template <typename scalar_t, int NQ>
inline int64_t team_scores_avx512(const Problem<scalar_t>&, Output*, const float*, int64_t r, int64_t) { return r; }
template <typename scalar_t, int NQ>
inline int64_t team_values_avx512(const Problem<scalar_t>&, Output*, int64_t, int64_t) { return 0; }
inline int64_t exp_avx512(Output&, int64_t, float, __m256&) { return 0; }
#endif


template <typename scalar_t, bool kStream>
inline int64_t scores_pass(const Problem<scalar_t>& P, Output& o, const float* q, int64_t r, int64_t last) {
  r = team_scores_avx512<scalar_t, 1>(P, &o, q, r, last);
  const scalar_t* kbase = P.k + o.g * P.k_sh;
  const int64_t D = P.D;
  if (D % kLanes == 0) {
    const __m256 scale = _mm256_set1_ps(P.scale);
    for (; r + kLanes <= last; r += kLanes) {
      const scalar_t* kp[kLanes];
      for (int j = 0; j < kLanes; ++j) kp[j] = kbase + o.keys.at(r + j) * P.k_ss;
      if constexpr (kStream)
        for (int j = 0; j < kLanes; ++j) prefetch_row(kp[j], P.k_ss, P.D);
      __m256 a[kLanes];
      for (int j = 0; j < kLanes; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += kLanes) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < kLanes; ++j) a[j] = _mm256_fmadd_ps(qv, load8(kp[j] + d), a[j]);
      }
      const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
      const __m256 y = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
      const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
      _mm256_storeu_ps(o.scores + r, _mm256_mul_ps(sums, scale));
    }
  }
  return r;
}

template <typename scalar_t, bool kStream>
inline int64_t values_pass(const Problem<scalar_t>& P, Output& o, int64_t first, int64_t last) {
  const scalar_t* vbase = P.v + o.g * P.v_sh;
  const int64_t D = P.D;
  int64_t d0 = team_values_avx512<scalar_t, 1>(P, &o, first, last);
  if (D % kLanes == 0) {
    for (; d0 + 8 * kLanes <= D; d0 += 8 * kLanes) {  // 64 features at a time, in registers
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(o.acc + d0 + j * kLanes);
      for (int64_t i = first; i < last; ++i) {
        const scalar_t* vp = vbase + o.keys.at(i) * P.v_ss + d0;
        if constexpr (kStream)
          if (d0 == 0) prefetch_row(vp, P.v_ss, P.D);
        const __m256 e = _mm256_set1_ps(o.scores[i]);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(e, load8(vp + j * kLanes), a[j]);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(o.acc + d0 + j * kLanes, a[j]);
    }
    for (; d0 + kLanes <= D; d0 += kLanes) {
      __m256 a = _mm256_loadu_ps(o.acc + d0);
      for (int64_t i = first; i < last; ++i)
        a = _mm256_fmadd_ps(_mm256_set1_ps(o.scores[i]), load8(vbase + o.keys.at(i) * P.v_ss + d0), a);
      _mm256_storeu_ps(o.acc + d0, a);
    }
  }
  return d0;
}

template <typename scalar_t, int NQ, bool kStream>
inline int64_t team_scores_avx2_pass(const Problem<scalar_t>& P, Output* o, const float* q0, int64_t r, int64_t last) {
  r = team_scores_avx512<scalar_t, NQ>(P, o, q0, r, last);
  const scalar_t* kbase = P.k + o[0].g * P.k_sh;
  const int64_t D = P.D;
  if (D % kLanes == 0) {
    const __m128 scale = _mm_set1_ps(P.scale);
    for (; r + 4 <= last; r += 4) {
      const scalar_t* kp[4];
      for (int j = 0; j < 4; ++j) kp[j] = kbase + o[0].keys.at(r + j) * P.k_ss;
      if constexpr (kStream)
        for (int j = 0; j < 4; ++j) prefetch_row(kp[j], P.k_ss, P.D);
      __m256 a[NQ][4];
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += kLanes) {
        __m256 qv[NQ];
        for (int i = 0; i < NQ; ++i) qv[i] = _mm256_loadu_ps(q0 + i * D + d);
        for (int j = 0; j < 4; ++j) {
          const __m256 kv = load8(kp[j] + d);
          for (int i = 0; i < NQ; ++i) a[i][j] = _mm256_fmadd_ps(qv[i], kv, a[i][j]);
        }
      }
      for (int i = 0; i < NQ; ++i) {
        const __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
        const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
        _mm_storeu_ps(o[i].scores + r, _mm_mul_ps(sums, scale));
      }
    }
  }
  return r;
}

template <typename scalar_t, int NQ, bool kStream>
inline int64_t team_values_avx2_pass(const Problem<scalar_t>& P, Output* o, int64_t first, int64_t last) {
  const scalar_t* vbase = P.v + o[0].g * P.v_sh;
  const int64_t D = P.D;
  int64_t d0 = team_values_avx512<scalar_t, NQ>(P, o, first, last);
  if (D % kLanes == 0) {
    for (; d0 + 4 * kLanes <= D; d0 += 4 * kLanes) {
      __m256 a[NQ][4];
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) a[i][j] = _mm256_loadu_ps(o[i].acc + d0 + j * kLanes);
      for (int64_t s = first; s < last; ++s) {
        const scalar_t* vp = vbase + o[0].keys.at(s) * P.v_ss + d0;
        if constexpr (kStream)
          if (d0 == 0) prefetch_row(vp, P.v_ss, P.D);
        __m256 e[NQ];
        for (int i = 0; i < NQ; ++i) e[i] = _mm256_set1_ps(o[i].scores[s]);
        for (int j = 0; j < 4; ++j) {
          const __m256 vv = load8(vp + j * kLanes);
          for (int i = 0; i < NQ; ++i) a[i][j] = _mm256_fmadd_ps(e[i], vv, a[i][j]);
        }
      }
      for (int i = 0; i < NQ; ++i)
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o[i].acc + d0 + j * kLanes, a[i][j]);
    }
    for (; d0 + kLanes <= D; d0 += kLanes) {
      for (int i = 0; i < NQ; ++i) {
        __m256 a = _mm256_loadu_ps(o[i].acc + d0);
        for (int64_t s = first; s < last; ++s)
          a = _mm256_fmadd_ps(_mm256_set1_ps(o[i].scores[s]), load8(vbase + o[0].keys.at(s) * P.v_ss + d0), a);
        _mm256_storeu_ps(o[i].acc + d0, a);
      }
    }
  }
  return d0;
}

// The passes above with the K and V rows prefetched ahead where the problem has one query (see
// x86/avx512/tree_attention.h's team_scores_avx512), without it elsewhere.
template <typename scalar_t>
inline int64_t scores_avx2(const Problem<scalar_t>& P, Output& o, const float* q, int64_t r, int64_t last) {
  return P.T == 1 ? scores_pass<scalar_t, true>(P, o, q, r, last) : scores_pass<scalar_t, false>(P, o, q, r, last);
}
template <typename scalar_t>
inline int64_t values_avx2(const Problem<scalar_t>& P, Output& o, int64_t first, int64_t last) {
  return P.T == 1 ? values_pass<scalar_t, true>(P, o, first, last) : values_pass<scalar_t, false>(P, o, first, last);
}
template <typename scalar_t, int NQ>
inline int64_t team_scores_avx2(const Problem<scalar_t>& P, Output* o, const float* q0, int64_t r, int64_t last) {
  return P.T == 1 ? team_scores_avx2_pass<scalar_t, NQ, true>(P, o, q0, r, last)
                  : team_scores_avx2_pass<scalar_t, NQ, false>(P, o, q0, r, last);
}
template <typename scalar_t, int NQ>
inline int64_t team_values_avx2(const Problem<scalar_t>& P, Output* o, int64_t first, int64_t last) {
  return P.T == 1 ? team_values_avx2_pass<scalar_t, NQ, true>(P, o, first, last)
                  : team_values_avx2_pass<scalar_t, NQ, false>(P, o, first, last);
}

inline int64_t max_avx2(const Output& o, int64_t n, float& best) {
  int64_t m = 0;
  {  // the maximum is exact in any order (NaN scores are skipped, as below)
    __m256 top = _mm256_set1_ps(-INFINITY);
    // four independent maxima of 8 lanes (one chain waits on each vmaxps's latency), then one
    __m256 t1 = top, t2 = top, t3 = top;
    for (; m + 4 * kLanes <= n; m += 4 * kLanes) {
      top = _mm256_max_ps(_mm256_loadu_ps(o.scores + m), top);
      t1 = _mm256_max_ps(_mm256_loadu_ps(o.scores + m + kLanes), t1);
      t2 = _mm256_max_ps(_mm256_loadu_ps(o.scores + m + 2 * kLanes), t2);
      t3 = _mm256_max_ps(_mm256_loadu_ps(o.scores + m + 3 * kLanes), t3);
    }
    top = _mm256_max_ps(_mm256_max_ps(t1, top), _mm256_max_ps(t3, t2));
    for (; m + kLanes <= n; m += kLanes) top = _mm256_max_ps(_mm256_loadu_ps(o.scores + m), top);
    float lane[kLanes];
    _mm256_storeu_ps(lane, top);
    for (int j = 0; j < kLanes; ++j) best = lane[j] > best ? lane[j] : best;
  }
  return m;
}

inline int64_t exp_avx2(Output& o, int64_t n, float best, float* total) {
  int64_t r = 0;
  {
    const __m256 top = _mm256_set1_ps(best);
    __m256 tv = _mm256_setzero_ps();
    r = exp_avx512(o, n, best, tv);
    for (; r + kLanes <= n; r += kLanes) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(o.scores + r), top));
      _mm256_storeu_ps(o.scores + r, e);
      tv = _mm256_add_ps(tv, e);
    }
    _mm256_storeu_ps(total, tv);
  }
  return r;
}
