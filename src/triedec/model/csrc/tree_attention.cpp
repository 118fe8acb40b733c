// Tree attention with a fixed reduction order (triedec's own kernel; see triedec/attention.py).
//
// out[t, h] = sum_r e_r v[k_r] / sum_r e_r, e_r = exp(s_r - max s), s_r = scale * <q[h, t], k[k_r]>,
// over the key slots k_0 < k_1 < ... visible to query t. Every sum runs in an order fixed by the
// rank r of a key among the keys its query sees and by the feature index d, never by how many
// queries the call carries, which other keys exist, or how a loop is vectorized:
//   * a dot product: 8 partial sums (d mod 8), each a chain of fused multiply-adds in d order,
//     combined as ((0+1)+(2+3))+((4+5)+(6+7));
//   * the softmax denominator: 8 partial sums (r mod 8) in r order, combined the same way;
//   * the weighted values: one chain of fused multiply-adds per feature, in r order;
//   * exp: a polynomial of IEEE operations (Cody-Waite reduction, Cephes' coefficients).
// The AVX-512 path, the AVX2 path and the portable scalar path perform the same IEEE operations on
// every element (each correctly rounded, so a vector lane and a scalar give the same bits; the file is compiled
// with -ffp-contract=off and without -ffast-math, so the compiler adds no fusion or reassociation
// of its own). Two queries that see the same key and value vectors in the same order therefore
// get the same bits, whatever else the call holds. Threads split the work by (query, head), each
// computing whole outputs, so the thread count changes nothing either.
//
// Speed without changing an operation: the heads of one query that share a key/value head see the
// same keys, so they go as a team (up to 3, what the registers hold) and each K or V vector loaded
// serves them all; a thread takes its outputs in blocks whose scores stay in L2; the maximum score
// is found in four chains of 8 lanes (a maximum is exact in any order); a key scored alone keeps its
// 8 partial sums in one register's lanes; on AVX-512 the exponentials go 16 at a time.
// Tried and not kept (measured on a Xeon with AVX-512, issue 79): teams of several queries over the
// keys they share (a prompt chunk's or a tree's cache), also with a chunk's keys transposed so that
// 16 keys' sums fill a register; the same bits, no faster, the scores being bound by the broadcasts
// of the query's features and the combining of each key's 8 partial sums rather than by K's loads.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TRIEDEC_AVX2 1
#endif

namespace {

constexpr int kLanes = 8;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: (x + kRound) - kRound rounds x to an integer
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
constexpr float kUnderflow = -87.0f;

// exp(x) for x <= 0 (a score minus the maximum); 0 below -87. Relative error ~1e-7.
inline float exp_scalar(float x) {
  if (!(x > kUnderflow)) return 0.0f;
  const float n = (x * kLog2e + kRound) - kRound;
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kP0;
  p = std::fma(p, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  p = std::fma(p * r, r, r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

inline float combine(const float* lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

template <typename T>
inline float to_float(T x) { return static_cast<float>(x); }

struct Keys {  // the key slots one query sees: indices[0..count), or 0..count-1 when indices is null
  const int32_t* indices;
  int64_t count;
  int64_t at(int64_t r) const { return indices ? indices[r] : r; }
  int64_t below(int64_t from, int64_t stop) const {  // the first rank >= from whose slot is >= stop
    if (!indices) return std::max(from, std::min(count, stop));
    return std::lower_bound(indices + from, indices + count, static_cast<int32_t>(std::min<int64_t>(stop, INT32_MAX)))
           - indices;
  }
};

template <typename scalar_t>
using Problem = triedec::AttentionProblem<scalar_t>;

constexpr int64_t kChunk = 64;  // key slots per pass over a block of outputs: 64 rows of K (or V) stay in L1

struct Output {  // one (query, head): its keys, where it is in them, its scores and its running sums
  int64_t t, h, g;
  Keys keys;
  int64_t cursor;
  float* scores;
  float* acc;
  float best;
};

// ---- the AVX2 path ----------------------------------------------------------------------------
// Each function below vectorises the leading part of one loop of the portable code that follows
// (the same IEEE operations on every element) and returns where that scalar loop goes on. A build
// without AVX2 (the portable one) gets the versions in the #else branch, which leave it all to the
// scalar loops. Which build runs is chosen at import (triedec.model.native).
#ifdef TRIEDEC_AVX2
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

// ---- the AVX-512 path -------------------------------------------------------------------------
// The same IEEE operations per element again, 16 lanes at a time. A score's 8 partial sums (d mod
// 8) sit in 8 lanes, so a 16-lane register carries two keys' (lanes 0-7 one key, 8-15 the next)
// against the query's 8 features broadcast to both halves; the partial sums are combined by the
// same additions as the AVX2 path's hadd tree ((0+1)+(2+3))+((4+5)+(6+7)), here on shuffles within
// each 128-bit lane. The weighted values are one chain per feature, 16 features per register. Each
// returns where the AVX2 loop goes on.
#if defined(__AVX512F__) && defined(__AVX512DQ__)
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

template <typename scalar_t, int NQ>
inline int64_t team_scores_avx512(const Problem<scalar_t>& P, Output* o, const float* q0, int64_t r, int64_t last) {
  const scalar_t* kbase = P.k + o[0].g * P.k_sh;
  const int64_t D = P.D;
  if (D % kLanes != 0) return r;
  const __m128 scale = _mm_set1_ps(P.scale);
  for (; r + 8 <= last; r += 8) {  // 8 keys: pairs (0,1), (2,3), (4,5), (6,7), one register each
    const scalar_t* kp[8];
    for (int j = 0; j < 8; ++j) kp[j] = kbase + o[0].keys.at(r + j) * P.k_ss;
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

template <typename scalar_t, int NQ>
inline int64_t team_values_avx512(const Problem<scalar_t>& P, Output* o, int64_t first, int64_t last) {
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
#else
template <typename scalar_t, int NQ>
inline int64_t team_scores_avx512(const Problem<scalar_t>&, Output*, const float*, int64_t r, int64_t) { return r; }
template <typename scalar_t, int NQ>
inline int64_t team_values_avx512(const Problem<scalar_t>&, Output*, int64_t, int64_t) { return 0; }
#endif

template <typename scalar_t>
inline int64_t scores_avx2(const Problem<scalar_t>& P, Output& o, const float* q, int64_t r, int64_t last) {
  r = team_scores_avx512<scalar_t, 1>(P, &o, q, r, last);
  const scalar_t* kbase = P.k + o.g * P.k_sh;
  const int64_t D = P.D;
  if (D % kLanes == 0) {
    const __m256 scale = _mm256_set1_ps(P.scale);
    for (; r + kLanes <= last; r += kLanes) {
      const scalar_t* kp[kLanes];
      for (int j = 0; j < kLanes; ++j) kp[j] = kbase + o.keys.at(r + j) * P.k_ss;
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

template <typename scalar_t>
inline int64_t values_avx2(const Problem<scalar_t>& P, Output& o, int64_t first, int64_t last) {
  const scalar_t* vbase = P.v + o.g * P.v_sh;
  const int64_t D = P.D;
  int64_t d0 = team_values_avx512<scalar_t, 1>(P, &o, first, last);
  if (D % kLanes == 0) {
    for (; d0 + 8 * kLanes <= D; d0 += 8 * kLanes) {  // 64 features at a time, in registers
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_loadu_ps(o.acc + d0 + j * kLanes);
      for (int64_t i = first; i < last; ++i) {
        const scalar_t* vp = vbase + o.keys.at(i) * P.v_ss + d0;
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

template <typename scalar_t, int NQ>
inline int64_t team_scores_avx2(const Problem<scalar_t>& P, Output* o, const float* q0, int64_t r, int64_t last) {
  r = team_scores_avx512<scalar_t, NQ>(P, o, q0, r, last);
  const scalar_t* kbase = P.k + o[0].g * P.k_sh;
  const int64_t D = P.D;
  if (D % kLanes == 0) {
    const __m128 scale = _mm_set1_ps(P.scale);
    for (; r + 4 <= last; r += 4) {
      const scalar_t* kp[4];
      for (int j = 0; j < 4; ++j) kp[j] = kbase + o[0].keys.at(r + j) * P.k_ss;
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

template <typename scalar_t, int NQ>
inline int64_t team_values_avx2(const Problem<scalar_t>& P, Output* o, int64_t first, int64_t last) {
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
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    // 16 scores a pass, exp8's operations on each; the 8 chains of the denominator (rank mod 8)
    // take the low 8 lanes, then the high 8, so each still adds in rank order
    const __m512 top16 = _mm512_set1_ps(best);
    for (; r + 2 * kLanes <= n; r += 2 * kLanes) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(o.scores + r), top16));
      _mm512_storeu_ps(o.scores + r, e);
      tv = _mm256_add_ps(tv, _mm512_castps512_ps256(e));
      tv = _mm256_add_ps(tv, _mm512_extractf32x8_ps(e, 1));
    }
#endif
    for (; r + kLanes <= n; r += kLanes) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(o.scores + r), top));
      _mm256_storeu_ps(o.scores + r, e);
      tv = _mm256_add_ps(tv, e);
    }
    _mm256_storeu_ps(total, tv);
  }
  return r;
}
#else
template <typename scalar_t>
inline int64_t scores_avx2(const Problem<scalar_t>&, Output&, const float*, int64_t r, int64_t) { return r; }
template <typename scalar_t>
inline int64_t values_avx2(const Problem<scalar_t>&, Output&, int64_t, int64_t) { return 0; }
template <typename scalar_t, int NQ>
inline int64_t team_scores_avx2(const Problem<scalar_t>&, Output*, const float*, int64_t r, int64_t) { return r; }
template <typename scalar_t, int NQ>
inline int64_t team_values_avx2(const Problem<scalar_t>&, Output*, int64_t, int64_t) { return 0; }
inline int64_t max_avx2(const Output&, int64_t, float&) { return 0; }
inline int64_t exp_avx2(Output&, int64_t, float, float*) { return 0; }
#endif

// ---- the portable path (and the tails of the AVX2 one) --------------------------------------------

// one key's score: 8 partial sums (d mod 8), each a chain of fused multiply-adds in d order, combined
// as combine() does; with AVX2 the 8 chains are the 8 lanes of one register
template <typename scalar_t>
inline float dot_one(const float* q, const scalar_t* kp, int64_t D) {
  float lane[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
#ifdef TRIEDEC_AVX2
  if (D % kLanes == 0) {
    __m256 a = _mm256_setzero_ps();
    for (; d < D; d += kLanes) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(kp + d), a);
    _mm256_storeu_ps(lane, a);
  }
#endif
  for (; d < D; ++d) lane[d % kLanes] = std::fma(q[d], to_float(kp[d]), lane[d % kLanes]);
  return combine(lane);
}

template <typename scalar_t>
inline void scores_until(const Problem<scalar_t>& P, Output& o, const float* q, int64_t stop) {
  // the scores of o's keys whose slot is below `stop`, from o.cursor on; each score on its own
  const scalar_t* kbase = P.k + o.g * P.k_sh;
  const int64_t D = P.D;
  int64_t r = o.cursor;
  const int64_t last = o.keys.below(r, stop);
  r = scores_avx2(P, o, q, r, last);
  for (; r < last; ++r) o.scores[r] = dot_one(q, kbase + o.keys.at(r) * P.k_ss, D) * P.scale;
  o.cursor = last;
}

template <typename scalar_t>
inline void values_until(const Problem<scalar_t>& P, Output& o, int64_t stop) {
  // acc[d] += e_r * v[k_r][d] for o's keys whose slot is below `stop`, in rank order
  const scalar_t* vbase = P.v + o.g * P.v_sh;
  const int64_t D = P.D, first = o.cursor;
  const int64_t last = o.keys.below(first, stop);
  const int64_t d0 = values_avx2(P, o, first, last);
  for (int64_t i = first; i < last && d0 < D; ++i) {
    const scalar_t* vp = vbase + o.keys.at(i) * P.v_ss;
    for (int64_t d = d0; d < D; ++d) o.acc[d] = std::fma(o.scores[i], to_float(vp[d]), o.acc[d]);
  }
  o.cursor = last;
}

// Several outputs that see the same keys (the heads of one query that share a key/value head):
// each K or V vector loaded once serves them all. Every output's sums are formed by exactly the
// operations of scores_until / values_until, in the same order, so the bits are the same.
template <typename scalar_t, int NQ>
inline void team_scores(const Problem<scalar_t>& P, Output* o, const float* q0, int64_t stop) {
  const scalar_t* kbase = P.k + o[0].g * P.k_sh;
  const int64_t D = P.D;
  int64_t r = o[0].cursor;
  const int64_t last = o[0].keys.below(r, stop);
  r = team_scores_avx2<scalar_t, NQ>(P, o, q0, r, last);
  for (int i = 0; i < NQ; ++i) {
    const float* q = q0 + i * D;
    for (int64_t s = r; s < last; ++s) o[i].scores[s] = dot_one(q, kbase + o[0].keys.at(s) * P.k_ss, D) * P.scale;
    o[i].cursor = last;
  }
}

template <typename scalar_t, int NQ>
inline void team_values(const Problem<scalar_t>& P, Output* o, int64_t stop) {
  const scalar_t* vbase = P.v + o[0].g * P.v_sh;
  const int64_t D = P.D, first = o[0].cursor;
  const int64_t last = o[0].keys.below(first, stop);
  const int64_t d0 = team_values_avx2<scalar_t, NQ>(P, o, first, last);
  for (int i = 0; i < NQ; ++i) {
    for (int64_t s = first; s < last && d0 < D; ++s) {
      const scalar_t* vp = vbase + o[0].keys.at(s) * P.v_ss;
      for (int64_t d = d0; d < D; ++d) o[i].acc[d] = std::fma(o[i].scores[s], to_float(vp[d]), o[i].acc[d]);
    }
    o[i].cursor = last;
  }
}

inline float exponentiate(Output& o) {
  // scores -> exp(score - max) in place; returns the denominator (8 partial sums by rank mod 8)
  const int64_t n = o.keys.count;
  float best = -INFINITY;
  const int64_t m = max_avx2(o, n, best);
  for (int64_t i = m; i < n; ++i) best = o.scores[i] > best ? o.scores[i] : best;
  float total[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t r = exp_avx2(o, n, best, total); r < n; ++r) {
    o.scores[r] = exp_scalar(o.scores[r] - best);
    total[r % kLanes] += o.scores[r];
  }
  return combine(total);
}

template <typename scalar_t>
void attend_block(const Problem<scalar_t>& P, int64_t begin, int64_t end) {
  // outputs [begin, end) in (kv head, query, head within the group) order, so that the outputs
  // of one block read the same K/V chunk while it is in cache
  const int64_t D = P.D, count = end - begin;
  std::vector<Output> outs(count);
  std::vector<float> qf(count * D), acc(count * D, 0.0f);
  std::vector<int64_t> start(count + 1, 0);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t w = begin + i, per_g = P.T * P.group;
    const int64_t g = w / per_g, t = (w % per_g) / P.group, h = g * P.group + w % P.group;
    const Keys keys = P.offsets ? Keys{P.indices + P.offsets[t], P.offsets[t + 1] - P.offsets[t]} : Keys{nullptr, P.S};
    outs[i] = Output{t, h, g, keys, 0, nullptr, acc.data() + i * D, 0.0f};
    start[i + 1] = start[i] + keys.count;
    const scalar_t* qp = P.q + h * P.q_sh + t * P.q_st;
    for (int64_t d = 0; d < D; ++d) qf[i * D + d] = to_float(qp[d]);
  }
  std::vector<float> scores(start[count]);
  for (int64_t i = 0; i < count; ++i) outs[i].scores = scores.data() + start[i];
  // teams: runs of outputs that see the same keys (one query's heads on one key/value head), in
  // pieces of at most 3 (what the registers hold)
  std::vector<std::pair<int64_t, int>> teams;
  for (int64_t i = 0; i < count;) {
    int64_t j = i;
    while (j < count && outs[j].t == outs[i].t && outs[j].g == outs[i].g) ++j;
    for (int64_t left = j - i; left > 0;) {
      const int size = left == 4 ? 2 : static_cast<int>(std::min<int64_t>(left, 3));
      teams.emplace_back(j - left, size);
      left -= size;
    }
    i = j;
  }
  for (int64_t c = kChunk; c < P.S + kChunk; c += kChunk)
    for (const auto& [i, size] : teams) {
      if (size == 3) team_scores<scalar_t, 3>(P, &outs[i], qf.data() + i * D, c);
      else if (size == 2) team_scores<scalar_t, 2>(P, &outs[i], qf.data() + i * D, c);
      else scores_until(P, outs[i], qf.data() + i * D, c);
    }
  std::vector<float> totals(count);
  for (int64_t i = 0; i < count; ++i) {
    if (P.softcap > 0.0f)
      for (int64_t r = 0; r < outs[i].keys.count; ++r)
        outs[i].scores[r] = P.softcap * std::tanh(outs[i].scores[r] / P.softcap);
    totals[i] = exponentiate(outs[i]);
    outs[i].cursor = 0;
  }
  for (int64_t c = kChunk; c < P.S + kChunk; c += kChunk)
    for (const auto& [i, size] : teams) {
      if (size == 3) team_values<scalar_t, 3>(P, &outs[i], c);
      else if (size == 2) team_values<scalar_t, 2>(P, &outs[i], c);
      else values_until(P, outs[i], c);
    }
  for (int64_t i = 0; i < count; ++i) {
    scalar_t* op = P.out + (outs[i].t * P.H + outs[i].h) * D;
    for (int64_t d = 0; d < D; ++d) op[d] = static_cast<scalar_t>(outs[i].acc[d] / totals[i]);
  }
}

}  // namespace

namespace triedec {

template <typename scalar_t>
void tree_attention_run(const std::vector<AttentionProblem<scalar_t>>& problems) {
  // every item's outputs in one parallel loop: item k owns outputs [first[k], first[k + 1]) of the
  // whole work; each output is computed exactly as in a call of its own
  std::vector<int64_t> first(problems.size() + 1, 0);
  for (size_t k = 0; k < problems.size(); ++k) first[k + 1] = first[k] + problems[k].T * problems[k].H;
  const int64_t work = first.back();
  if (work == 0) return;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), work));
  at::parallel_for(0, work, (work + threads - 1) / threads, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t pos = begin; pos < end; ++k) {
      const Problem<scalar_t>& P = problems[k];
      const int64_t stop = std::min(end, first[k + 1]);
      // a thread's outputs go in blocks whose scores stay in L2 (~32K floats), whole groups of heads
      const int64_t per_block = std::max<int64_t>(P.group, (32768 / std::max<int64_t>(P.S, 1)) / P.group * P.group);
      for (int64_t b = pos - first[k]; b < stop - first[k]; b += per_block)
        attend_block(P, b, std::min(stop - first[k], b + per_block));
      pos = stop;
    }
  });
}

template void tree_attention_run<float>(const std::vector<AttentionProblem<float>>&);
template void tree_attention_run<c10::BFloat16>(const std::vector<AttentionProblem<c10::BFloat16>>&);
template void tree_attention_run<c10::Half>(const std::vector<AttentionProblem<c10::Half>>&);

}  // namespace triedec
