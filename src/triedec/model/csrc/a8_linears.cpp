// Linear layers with quantized weights whose dot products run on 8-bit activations (triedec's own
// kernels; triedec/precision.py packs the weights and calls them). It is what llama.cpp does with a
// Q4 file: on a CPU, float dot products of many rows are bound by arithmetic (a 16-row forward of
// the default model is ~2 GMAC, ~22 ms at two cores' float peak), and integer dot products
// (AVX512-VNNI's vpdpbusd: 64 multiply-adds an instruction) do four times as many per instruction.
// Three paths give the same bits: AVX512-VNNI (tile4, tile8: x86/avx512/a8_linears.h), AVX2
// (tile4_avx2, tile8_avx2: x86/avx2/a8_linears.h, for the CPUs without AVX-512; with AVX-VNNI's
// 256-bit vpdpbusd in place of vpmaddubsw + vpmaddwd where the build has it) and a portable one
// (int4_portable, int8_portable, here); the build's ISA picks.
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
  int64_t ahead;               // how far ahead of its loads the tile prefetches the codes (0: not at all)
};

// How far ahead of its loads a tile that streams a block from memory prefetches its codes (the
// hardware's prefetcher alone left a one-row forward waiting on memory: its time the bytes' and
// the arithmetic's added, 1.2-1.9x as long on a Xeon's AVX-512 and AVX2 builds); the tiles after
// it read the block from the caches and do not.
constexpr int64_t kAheadBytes = 4096;

#endif

#if defined(TRIEDEC_VNNI)
#include "x86/avx512/a8_linears.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TRIEDEC_AMX 1
#include "x86/amx/a8_linears.h"
#endif
#elif defined(TRIEDEC_A8_AVX2)
#include "x86/avx2/a8_linears.h"
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
// Rows below `row0` are left alone (the AMX tiles' rows, where the build has them).
template <class Fill>
void for_each_tile(const Rows& xs, int64_t R, int64_t K, int64_t N, c10::BFloat16* out, Fill&& fill,
                   int64_t row0 = 0) {
  static_assert(kBlock == 4, "tiles.h cuts blocks of 4 vectors");
  const int64_t G = K / kGroup, NV = N / kCols;
  const int32_t* quads = reinterpret_cast<const int32_t*>(xs.q.data());
  triedec::for_each_row_tile(R - row0, kRows, (NV + kBlock - 1) / kBlock, [&](int64_t b, int64_t t0, int rows,
                                                                              bool streams) {
    const int64_t r0 = row0 + t0;
    alignas(64) float y[kRows * kBlock * kCols];
    RowTile x{};
    x.ahead = streams ? kAheadBytes : 0;  // the part's first tile streams the block: it prefetches
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
#ifdef TRIEDEC_VNNI
      for (int64_t v = 0; v < nvb; ++v)
        store_bf16(out + (r0 + r) * N + first + v * kCols, _mm512_load_ps(y + (r * nvb + v) * kCols));
#else
      for (int64_t i = 0; i < nvb * kCols; ++i)
        out[(r0 + r) * N + first + i] = static_cast<c10::BFloat16>(y[r * nvb * kCols + i]);
#endif
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

// The rows the AMX tiles take (x86/amx/a8_linears.h: int4, int8 and Q4_0 / Q4_1 layers): R rounded
// down to 16 where the build has them and the process may use them, else none; the register
// tiles take the rest. Each output is computed whole by one tile of either kind, in the same
// operations, so the cut changes no bits.
inline int64_t amx_rows(int64_t R) {
#ifdef TRIEDEC_AMX
  return R >= kAmxRows && amx_granted() ? R / kAmxRows * kAmxRows : 0;
#else
  (void)R;
  return 0;
#endif
}

// The vector paths: this build's tiles (VNNI's or AVX2's, and AMX's) over the blocks of the packed weight.
void int4_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const c10::BFloat16* sz, int64_t N,
                 c10::BFloat16* out) {
  const int64_t G = K / kGroup, first = amx_rows(R);
#ifdef TRIEDEC_AMX
  if (first) int4_amx(xs, first, K, packed, sz, N, out);
#endif
  if (first == R) return;
  for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                      float* y) {
    TRIEDEC_TILE4<decltype(rows)::value, decltype(vectors)::value>(packed + b * kBlock * (K / 8) * 64,
                                                                   sz + b * kBlock * G * 2 * kCols, nvb, K, x, y);
  }, first);
}

void int8_vector(const Rows& xs, int64_t R, int64_t K, const uint8_t* packed, const c10::Half* scales, int64_t N,
                 c10::BFloat16* out) {
  const int64_t G = K / kGroup, first = amx_rows(R);
#ifdef TRIEDEC_AMX
  if (first) int8_amx(xs, first, K, packed, scales, N, out);
#endif
  if (first == R) return;
  for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                      float* y) {
    TRIEDEC_TILE8<decltype(rows)::value, decltype(vectors)::value>(packed + b * kBlock * K * kCols,
                                                                   scales + b * kBlock * G * kCols, nvb, K, x, y);
  }, first);
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
  const int64_t G = K / kGroup, first = highs ? 0 : amx_rows(R);
#ifdef TRIEDEC_AMX
  if (first && mins) scale_min_amx<true>(xs, first, K, packed, dm, N, out);
  else if (first) scale_min_amx<false>(xs, first, K, packed, dm, N, out);
#endif
  if (first == R) return;
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
    }, first);
  else
    for_each_tile(xs, R, K, N, out, [&](auto rows, auto vectors, int64_t b, int64_t nvb, const RowTile& x,
                                        float* y) {
      TRIEDEC_TILESM<decltype(rows)::value, decltype(vectors)::value, false, false>(
          packed + b * kBlock * (K / 8) * 64, nullptr, dm + b * kBlock * G * kCols, nvb, K, x, y);
    }, first);
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
