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

// ---- the vector paths ------------------------------------------------------------------------
// x86/avx2/tree_attention.h (which includes x86/avx512/tree_attention.h on AVX-512): each function
// vectorises the leading part of one loop of the portable code that follows and returns where
// that scalar loop goes on. A build without AVX2 (the portable one) gets the versions below, which
// leave it all to the scalar loops. Which build runs is chosen at import (triedec.model.native).
#ifdef TRIEDEC_AVX2
#include "x86/avx2/tree_attention.h"
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
