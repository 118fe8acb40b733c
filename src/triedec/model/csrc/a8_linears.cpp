// Linear layers with quantized weights whose dot products run on 8-bit activations (triedec's own
// kernels; triedec/precision.py packs the weights and calls them). It is what llama.cpp does with a
// Q4 file: on a CPU, float dot products of many rows are bound by arithmetic (a 16-row forward of
// the default model is ~2 GMAC, ~22 ms at two cores' float peak), and integer dot products
// (AVX512-VNNI's vpdpbusd: 64 multiply-adds an instruction) do four times as many per instruction.
// Three paths give the same bits: AVX512-VNNI (tile4, tile8), AVX2 (tile4_avx2, tile8_avx2, for the
// CPUs without AVX-512; with AVX-VNNI's 256-bit vpdpbusd in place of vpmaddubsw + vpmaddwd where
// the build has it) and a portable one (int4_portable, int8_portable); the build's ISA picks.
//
// Activations: each row's features are quantized per group g of 32: a = max|x| / 127 and
// x' = round(x * (127 / max|x|)) in -127..127 (nearest even; a = 0 and x' = 0 for a group whose
// max |x| is below 1e-30); Q = sum_k x'_k.
//
// int4_linear: output n at feature k weighs w = (q - 8) * s + z, q in 0..15, with a bf16 scale s and
// zero z per group (the int4 mode's own values). For row r and output n, over the groups in order:
//   D = sum_k x'_k q_k                                     (int32: exact, in any order)
//   y = fma(a * D, s, y);  y = fma(a * Q, c, y)            (float32, c = z - 8 s)
// since a * (s * D + c * Q) = sum_k a x'_k ((q_k - 8) s + z).
// int8_linear: w = q * s, q in -127..127, with an fp16 scale s per output and group of 32 (a GGUF
// Q8_0 block's layout: the int8 layers of int4-a8 mode). For row r and output n, over the groups in
// order: D = sum_k x'_k q_k (int32, exact), y = fma(a * D, s, y).
// int5_linear: int8_linear's arithmetic on codes q in -16..15 held in 5 bits (a GGUF Q5_0 block's
// codes and fp16 scale, at the file's 5.5 bits a weight): u = q + 16 in 0..31, D = sum_k x'_k u_k
// - 16 Q = sum_k x'_k q_k, the same integer, then the same float steps, so the same bits as
// int8_linear on the same codes and scales.
// int6_linear: a GGUF Q6_K block's weights at their own 6.6 bits: w = q * S * d, q in -32..31, an
// int8 S per output and half group (16 features) and a float32 d per output and super-block of 256
// features (K a multiple of 256). u = q + 32 in 0..63; for row r and output n, over the groups in
// order: D_h = sum_k x'_k u_k - 32 Q_h over each half h of the group (Q_h: the half's sum of x'),
// I = S_0 D_0 + S_1 D_1 (int32, exact: |I| < 2^24), y = fma(a * I, d, y), d the group's
// super-block's.
// kquant_linear: a GGUF Q4_K or Q5_K block's weights as the file holds them: w = d sc q - dmin m, q
// in 0..15 (Q4_K) or 0..31 (Q5_K), an integer sc and m (0..63) per output and group of 32, a float32
// d and e = -dmin per output and super-block of 256 (K a multiple of 256). For row r and output n,
// over the groups in order: D = sum_k x'_k q_k, I = sc D, J = m Q (int32, exact: |I| < 2^23),
// y = fma(a * I, d, y); y = fma(a * J, e, y), d and e the group's super-block's.
//
// scale_min_linear: a GGUF Q4_0, Q4_1 or Q5_1 block's weights as the file holds them: w = d q + m, q
// in 0..15 or 0..31 (Q5_1), an fp16 d and m per output and group of 32; a Q4_0 block (w = d (q -
// 8)) holds d only, and m = -8 d is computed (exact in float32). For row r and output n, over the
// groups in order: D = sum_k x'_k q_k (int32, exact), y = fma(a * D, d, y); y = fma(a * Q, m, y):
// int4_linear's float steps with c = m.
//
// y is rounded once to bf16 (nearest even). The integer sums are exact and every float operation is
// one IEEE operation in a fixed order on values of the output's own row and column, so a row gets
// the same bits alone or in any call, and the vector paths and the portable one give the same bits
// (for finite activations: a NaN may take another group maximum on each).
//
// Packed layouts (triedec.precision.pack_int4 / pack_int8), for the 16 outputs 16v..16v+15:
//   int4: uint8, N * K / 2 bytes in blocks of 4 vectors (64 outputs; the last block may hold fewer,
//         nvb): block b, group g, step m (features 32g + 8m .. + 7), vector v of the block: 64 bytes
//         at b * 4 * K * 8 + ((g * 4 + m) * nvb + v) * 64, whose byte 4i + j holds q[16(4b + v) + i,
//         32g + 8m + j] in its low nibble and q[.., 32g + 8m + 4 + j] in its high one: one
//         sequential stream per block, read in that order;
//   int8: uint8, N * K bytes in the same blocks: block b, group g, step m (features 32g + 4m .. + 3),
//         vector v of the block: 64 bytes at b * 4 * K * 16 + ((g * 8 + m) * nvb + v) * 64, whose
//         byte 4i + j holds q[16(4b + v) + i, 32g + 4m + j] + 128 (vpdpbusd multiplies unsigned by
//         signed bytes; the 128 * Q it adds is taken off).
//   int5: int4's layout of u & 15 (uint8, N * K / 2 bytes), beside a plane of the high bits u >> 4
//         (uint8, N * K / 8 bytes): per block, group, step m and vector as int4's 64 bytes, 16
//         bytes at b * 4 * K * 2 + ((g * 4 + m) * nvb + v) * 16: two 64-bit masks, the first's bit
//         4i + j the high bit of the feature in byte 4i + j's low nibble (32g + 8m + j of output i),
//         the second's of the one in its high nibble (32g + 8m + 4 + j). Its scales are int8's.
//   int6: int4's layout of u & 15 (uint8, N * K / 2 bytes), beside the top two bits u >> 4 (uint8,
//         N * K / 4 bytes): per block, group, step m and vector, 32 bytes at b * 4 * K * 4 +
//         ((g * 4 + m) * nvb + v) * 32, whose byte k holds in bits 0-1 those of the code in the low
//         nibble of int4's byte k, in bits 2-3 of the low nibble of byte 32 + k, in bits 4-5 of the
//         high nibble of byte k, in bits 6-7 of the high nibble of byte 32 + k (so one 32-byte load
//         and a shift and a mask give a register of them). Its half-group scales S: int8, per block b and half group h (features
//         16h .. 16h + 15), the block's nvb * 16 at b * 4 * (K / 16) * 16 + h * nvb * 16; its
//         super-block scales d: float32, per block b and super-block t, the block's nvb * 16 at
//         b * 4 * (K / 256) * 16 + t * nvb * 16.
//   kquant: int4's layout of the codes (Q4_K) or int5's codes and plane (Q5_K); scales_mins int8,
//         per block b and group g the block's nvb * 16 sc then its m at b * 4 * (K / 32) * 32 +
//         g * 2 * nvb * 16 (int4's scales and zeros' order); supers float32, per block b and
//         super-block t the block's nvb * 16 d then its e at b * 4 * (K / 256) * 32 + t * 2 * nvb * 16.
//   scale_min: int4's layout of the codes (Q4_0, Q4_1) or int5's codes and plane (Q5_1); d and m:
//         fp16 in int4's order of scales and zeros; Q4_0's d alone: fp16 in int8's order of scales.
// int4's scales and zeros: bf16, per block b and group g: the block's nvb * 16 scales, then its
// zeros, at b * 4 * (K / 32) * 32 + g * 2 * nvb * 16. int8's scales: fp16, per block b and group g
// the block's nvb * 16 scales at b * 4 * (K / 32) * 16 + g * nvb * 16. So a block's weights are two
// sequential streams, read in that order.
#include "kernels.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(TRIEDEC_VNNI256_EVEX)
#include <immintrin.h>
#define TRIEDEC_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TRIEDEC_A8_AVX2 1
// AVX-VNNI (Alder Lake and later, Zen 5): the 256-bit vpdpbusd in its VEX encoding. The
// avxvnni_evex build compiles the same tiles with the EVEX encoding of the same instruction
// (AVX512-VNNI + VL), so that a CPU with AVX-512 runs, and the tests check, the code an AVX-VNNI
// CPU runs (triedec/model/isa.py).
#if defined(__AVXVNNI__)
#define TRIEDEC_DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(TRIEDEC_VNNI256_EVEX) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TRIEDEC_DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif
#endif
#if defined(TRIEDEC_VNNI) || defined(TRIEDEC_A8_AVX2)
#define TRIEDEC_A8_VECTOR 1
#endif

namespace {

#ifdef TRIEDEC_A8_VECTOR
constexpr bool kVector = true;  // a vector path is built; a call takes it unless asked for the portable one
#else
constexpr bool kVector = false;
#endif

constexpr int kCols = static_cast<int>(triedec::kA8Cols);    // outputs per vector
constexpr int kGroup = static_cast<int>(triedec::kA8Group);  // input features per group (scale, zero, activation scale)
constexpr int kSteps = 4;   // steps of 8 features per group
constexpr int kBlock = 4;   // int4: vectors per block of the packed weight (one stream per block)
constexpr float kTiny = 1e-30f;  // a group whose max |x| is below this quantizes to zeros (127 / max would overflow)

struct Rows {        // the activations, quantized per row and group
  std::vector<int8_t> q;     // [R, K]
  std::vector<float> a;      // [R, G]: the scale of each group
  std::vector<float> aq;     // [R, G]: a * Q
  std::vector<int32_t> sum;  // [R, G]: Q
  std::vector<int32_t> half; // [R, 2G]: Q of each half of the group (features 0-15, 16-31)
};

// Row r, group g: a = top / 127 and x' = nearbyint(x * (127 / top)) clamped to -127..127 (as a
// float, before the conversion), top = max |x| over the group (a = 0, x' = 0 when top is below
// kTiny). The vector path performs the same IEEE operations (a maximum is exact in any order; the
// conversion rounds to nearest even).
void quantize_group_portable(const c10::BFloat16* xg, int8_t* q, float* a, float* aq, int32_t* sum, int32_t* half) {
  float x[kGroup];
  float top = 0.0f;
  for (int k = 0; k < kGroup; ++k) {
    x[k] = static_cast<float>(xg[k]);
    top = std::max(top, std::fabs(x[k]));
  }
  if (!(top > kTiny)) top = 0.0f;
  const float inv = top > 0.0f ? 127.0f / top : 0.0f;
  half[0] = half[1] = 0;
  for (int k = 0; k < kGroup; ++k) {
    const float clamped = std::fmin(std::fmax(x[k] * inv, -127.0f), 127.0f);  // fmax(NaN, -127) = -127
    const int32_t v = top > 0.0f ? static_cast<int32_t>(std::nearbyint(clamped)) : 0;
    q[k] = static_cast<int8_t>(v);
    half[k / (kGroup / 2)] += q[k];
  }
  const int32_t total = half[0] + half[1];
  *a = top / 127.0f;
  *aq = *a * static_cast<float>(total);
  *sum = total;
}

#ifdef TRIEDEC_VNNI
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
#elif defined(TRIEDEC_A8_AVX2)
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
#else
constexpr auto& quantize_group_vector = quantize_group_portable;  // never chosen: kVector is false
#endif

// Quantizes x [R, K] into a buffer of the calling thread's own, reused by its next call (no
// allocation once it has grown to the largest call; only this thread writes it, and the kernel's
// workers only read it before the call returns).
const Rows& quantize_rows(const c10::BFloat16* x, int64_t R, int64_t K, bool portable) {
  const int64_t G = K / kGroup;
  const auto quantize_group = kVector && !portable ? &quantize_group_vector : &quantize_group_portable;
  thread_local Rows out;
  out.q.resize(R * K);
  out.a.resize(R * G);
  out.aq.resize(R * G);
  out.sum.resize(R * G);
  out.half.resize(R * 2 * G);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      quantize_group(x + r * K + g * kGroup, out.q.data() + r * K + g * kGroup, &out.a[r * G + g], &out.aq[r * G + g],
                     &out.sum[r * G + g], &out.half[(r * G + g) * 2]);
  return out;
}

inline float bf16_value(const c10::BFloat16 v) { return static_cast<float>(v); }

// The portable paths: the same integer sums and the same float operations, one output at a time.

// Where output n of a weight lies in the blocked layout: its vector's block, the vector's index vb
// in that block, the block's count of vectors nvb, and the output's column i in its vector.
struct Place {
  int64_t block, vb, nvb, i;
};

// The walk every portable kernel shares: y = 0, then y = step(place, r, g, y) for each group g in
// order, for each row r of each output n; out[r, n] = bf16(y). A kernel gives only its group's step.
template <class Step>
void for_each_output_portable(int64_t R, int64_t K, int64_t N, c10::BFloat16* out, const Step& step) {
  const int64_t G = K / kGroup;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t v = n / kCols, block = v / kBlock;
      const Place p{block, v % kBlock, std::min<int64_t>(kBlock, N / kCols - block * kBlock), n % kCols};
      for (int64_t r = 0; r < R; ++r) {
        float y = 0.0f;
        for (int64_t g = 0; g < G; ++g) y = step(p, r, g, y);
        out[r * N + n] = static_cast<c10::BFloat16>(y);
      }
    }
  });
}

// sum_k x'_k u_k over group g of the output at p, for codes u in int4's layout (0..15), with
// int5's plane of fifth bits when highs is given (0..31).
inline int32_t nibble_dot(const uint8_t* packed, const uint8_t* highs, int64_t K, const Place& p, int64_t g,
                          const int8_t* xq) {
  int32_t D = 0;
  for (int m = 0; m < kSteps; ++m) {
    const int64_t step = (g * kSteps + m) * p.nvb + p.vb;
    const uint8_t* bytes = packed + p.block * kBlock * (K / 8) * 64 + step * 64 + 4 * p.i;
    const uint8_t* high = highs ? highs + p.block * kBlock * (K / 8) * 16 + step * 16 : nullptr;
    for (int j = 0; j < 4; ++j) {
      int lo = bytes[j] & 0x0F, hi = bytes[j] >> 4;
      if (high) {
        const int bit = 4 * static_cast<int>(p.i) + j;
        lo |= ((high[bit / 8] >> (bit % 8)) & 1) << 4;
        hi |= ((high[8 + bit / 8] >> (bit % 8)) & 1) << 4;
      }
      D += lo * xq[m * 8 + j] + hi * xq[m * 8 + 4 + j];
    }
  }
  return D;
}

void int4_portable(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const c10::BFloat16* sz, int64_t N,
                   c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_output_portable(R, K, N, out, [&](const Place& p, int64_t r, int64_t g, float y) {
    const int32_t D = nibble_dot(packed, nullptr, K, p, g, xs.q.data() + r * K + g * kGroup);
    const c10::BFloat16* at = sz + p.block * kBlock * G * 2 * kCols + (g * 2 * p.nvb + p.vb) * kCols + p.i;
    const float s = bf16_value(at[0]), z = bf16_value(at[p.nvb * kCols]);
    const float c = std::fma(-8.0f, s, z);
    const float aD = xs.a[r * G + g] * static_cast<float>(D);
    y = std::fma(aD, s, y);
    return std::fma(xs.aq[r * G + g], c, y);
  });
}

void scale_min_portable(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                        const c10::Half* dm, bool mins, int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup, per = mins ? 2 : 1;
  for_each_output_portable(R, K, N, out, [&](const Place& p, int64_t r, int64_t g, float y) {
    const int32_t D = nibble_dot(packed, highs, K, p, g, xs.q.data() + r * K + g * kGroup);
    const c10::Half* at = dm + p.block * kBlock * G * per * kCols + (g * per * p.nvb + p.vb) * kCols + p.i;
    const float d = static_cast<float>(at[0]), m = mins ? static_cast<float>(at[p.nvb * kCols]) : -8.0f * d;
    const float aD = xs.a[r * G + g] * static_cast<float>(D);
    y = std::fma(aD, d, y);
    return std::fma(xs.aq[r * G + g], m, y);
  });
}

void int8_portable(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const c10::Half* scales, int64_t N,
                   c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  constexpr int kQuads = kGroup / 4;
  for_each_output_portable(R, K, N, out, [&](const Place& p, int64_t r, int64_t g, float y) {
    int32_t D = 0;
    for (int m = 0; m < kQuads; ++m) {
      const uint8_t* bytes = packed + p.block * kBlock * K * kCols + ((g * kQuads + m) * p.nvb + p.vb) * 64 + 4 * p.i;
      const int8_t* xq = xs.q.data() + r * K + g * kGroup + m * 4;
      for (int j = 0; j < 4; ++j) D += static_cast<int32_t>(bytes[j]) * xq[j];
    }
    D -= 128 * xs.sum[r * G + g];
    const float s = static_cast<float>(scales[p.block * kBlock * G * kCols + (g * p.nvb + p.vb) * kCols + p.i]);
    const float aD = xs.a[r * G + g] * static_cast<float>(D);
    return std::fma(aD, s, y);
  });
}

void int5_portable(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                   const c10::Half* scales, int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_output_portable(R, K, N, out, [&](const Place& p, int64_t r, int64_t g, float y) {
    const int32_t D = nibble_dot(packed, highs, K, p, g, xs.q.data() + r * K + g * kGroup) - 16 * xs.sum[r * G + g];
    const float s = static_cast<float>(scales[p.block * kBlock * G * kCols + (g * p.nvb + p.vb) * kCols + p.i]);
    const float aD = xs.a[r * G + g] * static_cast<float>(D);
    return std::fma(aD, s, y);
  });
}

void kquant_portable(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                     const int8_t* scales_mins, const float* supers, int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup, T = K / 256;
  for_each_output_portable(R, K, N, out, [&](const Place& p, int64_t r, int64_t g, float y) {
    const int32_t D = nibble_dot(packed, highs, K, p, g, xs.q.data() + r * K + g * kGroup);
    const int8_t* sm = scales_mins + p.block * kBlock * G * 2 * kCols + (g * 2 * p.nvb + p.vb) * kCols + p.i;
    const float* de = supers + p.block * kBlock * T * 2 * kCols + ((g / 8) * 2 * p.nvb + p.vb) * kCols + p.i;
    const int32_t I = sm[0] * D, J = sm[p.nvb * kCols] * xs.sum[r * G + g];
    const float a = xs.a[r * G + g];
    y = std::fma(a * static_cast<float>(I), de[0], y);
    return std::fma(a * static_cast<float>(J), de[p.nvb * kCols], y);
  });
}

// Bits 4 and 5 of u (as 0x10 and 0x20) for the code in byte b's low (upper = 0) or high (upper = 1)
// nibble of a step of int6's layout: its 32 bytes of top bits at `tops`.
inline int int6_high_bits(const uint8_t* tops, int b, int upper) {
  return ((tops[b % 32] >> (4 * upper + 2 * (b / 32))) & 3) << 4;
}

void int6_portable(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                   const int8_t* subs, const float* supers, int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_output_portable(R, K, N, out, [&](const Place& p, int64_t r, int64_t g, float y) {
    int32_t I = 0;
    for (int h = 0; h < 2; ++h) {
      int32_t D = -32 * xs.half[(r * G + g) * 2 + h];
      for (int m = 2 * h; m < 2 * h + 2; ++m) {
        const int64_t step = (g * kSteps + m) * p.nvb + p.vb;
        const uint8_t* bytes = packed + p.block * kBlock * (K / 8) * 64 + step * 64 + 4 * p.i;
        const uint8_t* tops = highs + p.block * kBlock * (K / 8) * 32 + step * 32;
        const int8_t* xq = xs.q.data() + r * K + g * kGroup + m * 8;
        for (int j = 0; j < 4; ++j) {
          const int b = 4 * static_cast<int>(p.i) + j;
          D += ((bytes[j] & 0x0F) | int6_high_bits(tops, b, 0)) * xq[j];
          D += ((bytes[j] >> 4) | int6_high_bits(tops, b, 1)) * xq[4 + j];
        }
      }
      I += static_cast<int32_t>(subs[p.block * kBlock * (K / 16) * kCols + ((2 * g + h) * p.nvb + p.vb) * kCols + p.i]) * D;
    }
    const float d = supers[p.block * kBlock * (K / 256) * kCols + ((g / 8) * p.nvb + p.vb) * kCols + p.i];
    return std::fma(xs.a[r * G + g] * static_cast<float>(I), d, y);
  });
}

#ifdef TRIEDEC_A8_VECTOR
constexpr int kRows = 3;   // most rows per register tile (3 rows x 4 vectors: 12 sums and 12 accumulators)

// The activations of one register tile: row r's quads of features (xq[r][i] holds features
// 4i..4i+3), group scales a, a * Q and Q.
struct RowTile {
  const int32_t* xq[kRows];
  const float* a[kRows];
  const float* aq[kRows];
  const int32_t* sum[kRows];
  const int32_t* half[kRows];  // Q of each half group: [2G]
};
#endif

#ifdef TRIEDEC_VNNI
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
template <int R, int V, bool kFifth, int kBias, class Finish>
inline void tile_nibbles(const uint8_t* codes, const uint8_t* highs, int64_t nvb, int64_t K, const RowTile& x,
                         float* y_out, Finish&& finish) {
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
template <int R, int V>
inline void tile8(const uint8_t* codes, const c10::Half* scales, int64_t nvb, int64_t K,
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
      for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(codes + ((g * kQuads + m) * nvb + v) * 64);
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
template <int R, int V>
inline void tile6(const uint8_t* codes, const uint8_t* highs, const int8_t* subs, const float* supers, int64_t nvb,
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

#endif  // TRIEDEC_VNNI

#ifdef TRIEDEC_A8_AVX2
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
template <int R, int V, class S = c10::BFloat16, bool kMins = true>
inline void tile4_avx2(const uint8_t* codes, const S* sz, int64_t nvb, int64_t K,
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

// int8_linear's tile on AVX2: as tile4_avx2, the group's 8 steps of 4 features per vector.
template <int R, int V>
inline void tile8_avx2(const uint8_t* codes, const c10::Half* scales, int64_t nvb, int64_t K,
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
template <int R, int V, bool kFifth, int kBias, class Finish>
inline void tile_nibbles_avx2(const uint8_t* codes, const uint8_t* highs, int64_t nvb, int64_t K, const RowTile& x,
                              float* y_out, Finish&& finish) {
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
template <int R, int V>
inline void tile6_avx2(const uint8_t* codes, const uint8_t* highs, const int8_t* subs, const float* supers,
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
#endif  // TRIEDEC_A8_AVX2

#ifdef TRIEDEC_A8_VECTOR
// The loop both kernels share: tiles.h's cut of the rows and blocks, tiles of up to kRows rows x the
// block's nvb vectors. (Tiles of 4 rows x 2 vectors, which read every other 128 bytes of the stream
// in each of two passes, took ~1.5x as long at 3-4 rows. Tiles of even sizes, the larger first: a
// one-row tile does a third of the work per weight byte unpacked, and the first tile, which
// streams the block from memory, has the most arithmetic to overlap with it; in one process on the
// default model, against tiles of 3 with the rest last, 2-3% less time a forward at 7-16 rows, the
// same at 4. Parts of blocks: a layer of 576 outputs is 9 blocks; with one item per block a
// 16-row forward of the default model took ~1.25x as long.) For each tile,
// fill(rows, vectors, b, nvb, x, y) writes y [rows, vectors * 16] in float32 (rows and vectors as
// std::integral_constant); it is rounded to bf16 into out [R, N].
template <class Fill>
void for_each_tile(const Rows& xs, int64_t R, int64_t K, int64_t N, c10::BFloat16* out, Fill&& fill) {
  static_assert(kBlock == 4, "tiles.h cuts blocks of 4 vectors");
  const int64_t G = K / kGroup, NV = N / kCols;
  const int32_t* quads = reinterpret_cast<const int32_t*>(xs.q.data());
  triedec::for_each_row_tile(R, kRows, (NV + kBlock - 1) / kBlock, [&](int64_t b, int64_t r0, int rows) {
    alignas(64) float y[kRows * kBlock * kCols];
    RowTile x{};
    const int64_t nvb = std::min<int64_t>(kBlock, NV - b * kBlock);
    const int64_t first = b * kBlock * kCols;
    for (int r = 0; r < rows; ++r) {
      x.xq[r] = quads + (r0 + r) * (K / 4);
      x.a[r] = xs.a.data() + (r0 + r) * G;
      x.aq[r] = xs.aq.data() + (r0 + r) * G;
      x.sum[r] = xs.sum.data() + (r0 + r) * G;
      x.half[r] = xs.half.data() + (r0 + r) * 2 * G;
    }
    triedec::dispatch_tile<kRows>(rows, static_cast<int>(nvb), [&](auto tr, auto tv) { fill(tr, tv, b, nvb, x, y); });
    for (int r = 0; r < rows; ++r)
      for (int64_t i = 0; i < nvb * kCols; ++i)
        out[(r0 + r) * N + first + i] = static_cast<c10::BFloat16>(y[r * nvb * kCols + i]);
  });
}

#ifdef TRIEDEC_VNNI
#define TRIEDEC_TILE4 tile4
#define TRIEDEC_TILE5 tile5
#define TRIEDEC_TILE6 tile6
#define TRIEDEC_TILE8 tile8
#define TRIEDEC_TILEK tilek
#define TRIEDEC_TILESM tile_sm
#else
#define TRIEDEC_TILE4 tile4_avx2
#define TRIEDEC_TILE5 tile5_avx2
#define TRIEDEC_TILE6 tile6_avx2
#define TRIEDEC_TILE8 tile8_avx2
#define TRIEDEC_TILEK tilek_avx2
#define TRIEDEC_TILESM tile_sm_avx2
#endif

// The vector paths: this build's tiles (VNNI's or AVX2's) over the blocks of the packed weight.
void int4_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const c10::BFloat16* sz, int64_t N,
                 c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                      float* y) {
    TRIEDEC_TILE4<decltype(rows)::value, decltype(vectors)::value>(packed + b * kBlock * (K / 8) * 64,
                                                                   sz + b * kBlock * G * 2 * kCols, nvb, K, x, y);
  });
}

void int8_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const c10::Half* scales, int64_t N,
                 c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                      float* y) {
    TRIEDEC_TILE8<decltype(rows)::value, decltype(vectors)::value>(packed + b * kBlock * K * kCols,
                                                                   scales + b * kBlock * G * kCols, nvb, K, x, y);
  });
}

void int5_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                 const c10::Half* scales, int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                      float* y) {
    TRIEDEC_TILE5<decltype(rows)::value, decltype(vectors)::value>(
        packed + b * kBlock * (K / 8) * 64, highs + b * kBlock * (K / 8) * 16, scales + b * kBlock * G * kCols, nvb,
        K, x, y);
  });
}

void int6_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                 const int8_t* subs, const float* supers, int64_t N, c10::BFloat16* out) {
  for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                      float* y) {
    TRIEDEC_TILE6<decltype(rows)::value, decltype(vectors)::value>(
        packed + b * kBlock * (K / 8) * 64, highs + b * kBlock * (K / 8) * 32, subs + b * kBlock * (K / 16) * kCols,
        supers + b * kBlock * (K / 256) * kCols, nvb, K, x, y);
  });
}

void kquant_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                   const int8_t* scales_mins, const float* supers, int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                      float* y) {
    constexpr int kR = decltype(rows)::value, kV = decltype(vectors)::value;
    const uint8_t* codes = packed + b * kBlock * (K / 8) * 64;
    const int8_t* sm = scales_mins + b * kBlock * G * 2 * kCols;
    const float* de = supers + b * kBlock * (K / 256) * 2 * kCols;
    if (highs)
      TRIEDEC_TILEK<kR, kV, true>(codes, highs + b * kBlock * (K / 8) * 16, sm, de, nvb, K, x, y);
    else
      TRIEDEC_TILEK<kR, kV, false>(codes, nullptr, sm, de, nvb, K, x, y);
  });
}
// One tile loop per kind of block (with both tiles in one loop GCC allocated the 4-bit tile's
// registers worse: 2-5% slower at 16-64 rows on the AVX2 EPYC).
void scale_min_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                      const c10::Half* dm, bool mins, int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  if (highs)
    for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                        float* y) {
      TRIEDEC_TILESM<decltype(rows)::value, decltype(vectors)::value, true, true>(
          packed + b * kBlock * (K / 8) * 64, highs + b * kBlock * (K / 8) * 16, dm + b * kBlock * G * 2 * kCols, nvb,
          K, x, y);
    });
  else if (mins)
    for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                        float* y) {
      TRIEDEC_TILESM<decltype(rows)::value, decltype(vectors)::value, false, true>(
          packed + b * kBlock * (K / 8) * 64, nullptr, dm + b * kBlock * G * 2 * kCols, nvb, K, x, y);
    });
  else
    for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                        float* y) {
      TRIEDEC_TILESM<decltype(rows)::value, decltype(vectors)::value, false, false>(
          packed + b * kBlock * (K / 8) * 64, nullptr, dm + b * kBlock * G * kCols, nvb, K, x, y);
    });
}
#else
constexpr auto& int4_vector = int4_portable;  // never chosen: kVector is false
constexpr auto& scale_min_vector = scale_min_portable;
constexpr auto& kquant_vector = kquant_portable;
constexpr auto& int5_vector = int5_portable;
constexpr auto& int6_vector = int6_portable;
constexpr auto& int8_vector = int8_portable;
#endif

}  // namespace

namespace triedec {

bool a8_linears_vectorized() { return kVector; }

void int4_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed,
                      const c10::BFloat16* scales_zeros, int64_t N, c10::BFloat16* out, bool portable) {
  if (R == 0) return;
  const Rows& xs = quantize_rows(x, R, K, portable);
  if (kVector && !portable)
    int4_vector(xs, R, K, packed, scales_zeros, N, out);
  else
    int4_portable(xs, R, K, packed, scales_zeros, N, out);
}

void int8_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const c10::Half* scales,
                      int64_t N, c10::BFloat16* out, bool portable) {
  if (R == 0) return;
  const Rows& xs = quantize_rows(x, R, K, portable);
  if (kVector && !portable)
    int8_vector(xs, R, K, packed, scales, N, out);
  else
    int8_portable(xs, R, K, packed, scales, N, out);
}

void int5_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                      const c10::Half* scales, int64_t N, c10::BFloat16* out, bool portable) {
  if (R == 0) return;
  const Rows& xs = quantize_rows(x, R, K, portable);
  if (kVector && !portable)
    int5_vector(xs, R, K, packed, highs, scales, N, out);
  else
    int5_portable(xs, R, K, packed, highs, scales, N, out);
}

void int6_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                      const int8_t* subs, const float* supers, int64_t N, c10::BFloat16* out, bool portable) {
  if (R == 0) return;
  const Rows& xs = quantize_rows(x, R, K, portable);
  if (kVector && !portable)
    int6_vector(xs, R, K, packed, highs, subs, supers, N, out);
  else
    int6_portable(xs, R, K, packed, highs, subs, supers, N, out);
}

void kquant_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                        const int8_t* scales_mins, const float* supers, int64_t N, c10::BFloat16* out, bool portable) {
  if (R == 0) return;
  const Rows& xs = quantize_rows(x, R, K, portable);
  if (kVector && !portable)
    kquant_vector(xs, R, K, packed, highs, scales_mins, supers, N, out);
  else
    kquant_portable(xs, R, K, packed, highs, scales_mins, supers, N, out);
}

void scale_min_linear_rows(const c10::BFloat16* x, int64_t R, int64_t K, const uint8_t* packed, const uint8_t* highs,
                           const c10::Half* dm, bool mins, int64_t N, c10::BFloat16* out, bool portable) {
  if (R == 0) return;
  const Rows& xs = quantize_rows(x, R, K, portable);
  if (kVector && !portable)
    scale_min_vector(xs, R, K, packed, highs, dm, mins, N, out);
  else
    scale_min_portable(xs, R, K, packed, highs, dm, mins, N, out);
}

}  // namespace triedec
