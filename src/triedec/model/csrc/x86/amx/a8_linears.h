// triedec's 8-bit linears on AMX-INT8 (the avx512amx build: the avx512vnni build's code and this):
// the integer sums D of 16 rows x 16 outputs x one group of 32 features in one tile operation
// (tdpbsud: the activations' signed bytes times the codes as unsigned bytes), then the same float
// steps per element as the VNNI tiles (x86/avx512/a8_linears.h), in the same order over the groups,
// so the same bits. Included by a8_linears.cpp after the VNNI header where TRIEDEC_AMX is defined.
//
// The per-group scales force the tile unit's sums through memory once a group (AMX has no move
// from a tile to a vector register): each 16 x 16 block of sums is stored, and the float steps
// read it back. A group's tile operation is issued two groups ahead of the float steps that read
// its sums (two sets of tile registers, tmm0/2/4 and tmm1/3/5, and three buffers of sums), so the
// float steps never wait on a store's latency. The tile work and the float steps still do not run
// at once: across tilezero and tilestored the core does not overlap them, and a group costs about
// their sum (benchmarks/amx-cpu/results.md).
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

constexpr int kAmxRows = 16;  // rows of an AMX tile (the tile unit's most)

// Whether this process may use the tile registers: Linux grants their state per process on
// request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux 5.16 and later); where it is
// refused (an older kernel, a hypervisor that hides it) the VNNI tiles run every row.
inline bool amx_granted() {
  static const bool granted = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return granted;
}

struct alignas(64) AmxConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Loads this kernel's tile shapes on the calling thread: tmm0, tmm1 the sums (16 rows x 16 int32),
// tmm2, tmm3 the activations (16 rows x 32 bytes: one group), tmm4, tmm5 the codes (8 rows of 16
// outputs x 4 features). Loaded at the start of every work chunk, since other code on the thread
// (oneDNN) may have loaded shapes of its own, and released at its end.
inline void amx_configure() {
  AmxConfig c{};
  c.palette = 1;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = kAmxRows;
    c.colsb[t] = 64;
    c.rows[2 + t] = kAmxRows;
    c.colsb[2 + t] = kGroup;
    c.rows[4 + t] = kGroup / 4;
    c.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&c);
}

// The sums of one group into `sums` (16 rows x 16 int32, row-major): the activations' rows at
// `act` (a row every `act_stride` bytes), the codes' 8 rows of 64 bytes at `codes` (a row every
// `codes_stride` bytes), in tile registers C, A, B (GCC's tile intrinsics take the registers'
// numbers as literal tokens, hence a macro). The store names the 1 KiB it writes as its output
// instead of GCC's `_tile_stored`, whose clobber of all memory kept the 16 rows' accumulators
// in memory (stored and reloaded around every group); the loads read memory written before the
// tile loop starts (the activations before the parallel region, a panel before amx_barrier).
#define TRIEDEC_AMX_GROUP_SUMS(C, A, B, act, act_stride, codes, codes_stride, sums)                          \
  do {                                                                                                      \
    _tile_loadd(A, act, act_stride);                                                                        \
    _tile_loadd(B, codes, codes_stride);                                                                    \
    _tile_zero(C);                                                                                          \
    _tile_dpbsud(C, A, B);                                                                                  \
    __asm__ volatile("{tilestored\t%%tmm" #C ", (%1,%2,1)|tilestored\t[%1+%2*1], %%tmm" #C "}"             \
                     : "=m"(*reinterpret_cast<int32_t(*)[kAmxRows * kCols]>(sums))                          \
                     : "r"(sums), "r"(int64_t{64}));                                                        \
  } while (0)

// Orders the stores before it (a panel of unpacked codes) before the tile loads after it.
inline void amx_barrier() { __asm__ volatile("" ::: "memory"); }

// One vector (16 outputs) for 16 rows over every group in order: codes(g, slot) gives the group's
// codes as tdpbsud's 8 rows (their pointer and row stride; slot: the set of tile registers, 0 or
// 1), finish(g, sums, y) takes the group's float steps on its sums, y (one register a row) staying
// in registers from the first group to the last.
template <class Codes, class Finish>
inline void amx_vector(int64_t G, const int8_t* act, int64_t K, Codes&& codes, Finish&& finish,
                       __m512 (&y)[kAmxRows]) {
  alignas(64) int32_t sums[3][kAmxRows * kCols];
  const auto issue = [&](int64_t g, auto slot) {
    const auto [at, stride] = codes(g, decltype(slot)::value);
    int32_t* into = sums[g % 3];
    if constexpr (decltype(slot)::value == 0) TRIEDEC_AMX_GROUP_SUMS(0, 2, 4, act + g * kGroup, K, at, stride, into);
    else TRIEDEC_AMX_GROUP_SUMS(1, 3, 5, act + g * kGroup, K, at, stride, into);
  };
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) y[r] = _mm512_setzero_ps();
  issue(0, std::integral_constant<int, 0>{});
  if (G > 1) issue(1, std::integral_constant<int, 1>{});
  for (int64_t g = 0; g < G; g += 2) {
    if (g + 2 < G) issue(g + 2, std::integral_constant<int, 0>{});
    finish(g, sums[g % 3], y);
    if (g + 1 < G) {
      if (g + 3 < G) issue(g + 3, std::integral_constant<int, 1>{});
      finish(g + 1, sums[(g + 1) % 3], y);
    }
  }
}

// The nibble codes of vector v of a block (int4's layout) unpacked, every group, into tdpbsud's
// rows in a panel of the thread's own (8 rows of 64 bytes a group), once for all the vector's row
// tiles: row 2m holds features 8m..8m+3 of the 16 outputs (the low nibbles of step m's 64 bytes),
// row 2m + 1 features 8m+4..8m+7 (the high ones). (Unpacked into a scratch just before each
// group's tile load, the load waited for the stores: ~1.6x as long a group.)
struct NibbleCodes {
  const uint8_t* panel;

  struct alignas(64) Line {
    uint8_t bytes[64];
  };

  // The calling thread's panel, unpacked from the codes first where `fresh` (a vector's first row
  // tile), else as the thread's last call left it.
  static const uint8_t* of(bool fresh, const uint8_t* codes, int64_t nvb, int64_t v, int64_t G) {
    thread_local std::vector<Line> rows;
    if (!fresh) return rows.data()->bytes;
    rows.resize(G * (kGroup / 4));
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t g = 0; g < G; ++g)
      for (int m = 0; m < kSteps; ++m) {
        const uint8_t* at = codes + ((g * kSteps + m) * nvb + v) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(at + kAheadBytes), _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512(at);
        _mm512_store_si512(rows[g * 8 + 2 * m].bytes, _mm512_and_si512(bytes, low));
        _mm512_store_si512(rows[g * 8 + 2 * m + 1].bytes, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low));
      }
    amx_barrier();
    return rows.data()->bytes;
  }

  std::pair<const uint8_t*, int64_t> operator()(int64_t g, int) const { return {panel + g * (kGroup / 4) * 64, 64}; }
};

// The int8 codes of vector v (int8's layout: step m's 64 bytes are features 4m..4m+3 of the 16
// outputs, as tdpbsud reads a row): read in place, a row every nvb * 64 bytes.
struct ByteCodes {
  const uint8_t* codes;
  int64_t nvb, v;
  bool ahead;

  std::pair<const uint8_t*, int64_t> operator()(int64_t g, int) const {
    const uint8_t* at = codes + (g * (kGroup / 4) * nvb + v) * 64;
    if (ahead)
      for (int m = 0; m < kGroup / 4; ++m)
        _mm_prefetch(reinterpret_cast<const char*>(at + m * nvb * 64 + kAheadBytes), _MM_HINT_T0);
    return {at, nvb * 64};
  }
};

// The rows [r0, r0 + 16) of an AMX tile's activations: group scales a, a * Q and Q, a row's
// every G.
struct AmxRows {
  const int8_t* q;
  const float* a;
  const float* aq;
  const int32_t* sum;
  int64_t G;
};

// scale_min_linear's steps (Q4_0, Q4_1) and int4_linear's, as tile_sm's and tile4's: y = fma(a D, d, y);
// y = fma(a Q, m, y), d and m (int4: s and c = z - 8 s) of the group's vector v.
template <class Scales>
inline void amx_scale_min_steps(const int32_t* sums, int64_t g, const AmxRows& x, Scales&& scales,
                                __m512 (&y)[kAmxRows]) {
  const auto [scale, mins] = scales(g);
#pragma GCC unroll 16
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 aD = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kCols)),
                                    _mm512_set1_ps(x.a[r * x.G + g]));
    y[r] = _mm512_fmadd_ps(aD, scale, y[r]);
    y[r] = _mm512_fmadd_ps(_mm512_set1_ps(x.aq[r * x.G + g]), mins, y[r]);
  }
}

// Row tiles a parallel region takes at most: a region's items read every one of its rows'
// activations once a vector, from L1 and L2 at up to 64 rows (the int8 head of 256 rows in one
// region ran at 0.92x the VNNI tiles; in regions of 64 rows at 1.1-1.4x from 16 to 64).
constexpr int64_t kAmxChunk = 4;

// Every 16-row tile of rows [0, R16) (R16 a multiple of 16) x every vector of N outputs: per
// chunk of kAmxChunk row tiles a parallel region, the vectors its work items over torch's threads,
// each item its vector's row tiles in order (the first streams the codes, prefetching them; the
// others read them from the caches): column(b, v, nvb, t, x, y) computes vector v of block b for
// row tile t into y, rounded to bf16 into out [R, N].
template <class Column>
void for_each_amx_tile(const Rows& xs, int64_t R16, int64_t K, int64_t N, c10::BFloat16* out, Column&& column) {
  const int64_t NV = N / kCols, T = R16 / kAmxRows, G = K / kGroup;
  for (int64_t c0 = 0; c0 < T; c0 += kAmxChunk) at::parallel_for(0, NV, 1, [&](int64_t i0, int64_t i1) {
    amx_configure();
    for (int64_t vg = i0; vg < i1; ++vg) {
      const int64_t b = vg / kBlock, nvb = std::min<int64_t>(kBlock, NV - b * kBlock);
      for (int64_t t = c0; t < std::min(T, c0 + kAmxChunk); ++t) {
        const int64_t r0 = t * kAmxRows;
        const AmxRows x{xs.q.data() + r0 * K, xs.a.data() + r0 * G, xs.aq.data() + r0 * G, xs.sum.data() + r0 * G,
                        G};
        __m512 y[kAmxRows];
        column(b, vg % kBlock, nvb, t, x, y);
#pragma GCC unroll 16
        for (int r = 0; r < kAmxRows; ++r) store_bf16(out + (r0 + r) * N + vg * kCols, y[r]);
      }
    }
    _tile_release();
  });
}

// The AMX paths: rows [0, R16) of each kind the VNNI tiles run, the rest left to them.
inline void int4_amx(const Rows& xs, int64_t R16, int64_t K, const uint8_t* packed, const c10::BFloat16* sz,
                     int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_amx_tile(xs, R16, K, N, out, [&](int64_t b, int64_t v, int64_t nvb, int64_t t, const AmxRows& x,
                                            __m512 (&y)[kAmxRows]) {
    const NibbleCodes codes{NibbleCodes::of(t % kAmxChunk == 0, packed + b * kBlock * (K / 8) * 64, nvb, v, G)};
    const c10::BFloat16* zs = sz + b * kBlock * G * 2 * kCols;
    amx_vector(G, x.q, K, codes, [&](int64_t g, const int32_t* sums, __m512 (&acc)[kAmxRows]) {
      amx_scale_min_steps(sums, g, x, [&](int64_t group) {
        const c10::BFloat16* at = zs + (group * 2 * nvb + v) * kCols;
        const __m512 scale = bf16_to_float(at);
        return std::pair{scale, _mm512_fmadd_ps(_mm512_set1_ps(-8.0f), scale, bf16_to_float(at + nvb * kCols))};
      }, acc);
    }, y);
  });
}

template <bool kMins>
inline void scale_min_amx(const Rows& xs, int64_t R16, int64_t K, const uint8_t* packed, const c10::Half* dm,
                          int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  constexpr int kPer = kMins ? 2 : 1;
  for_each_amx_tile(xs, R16, K, N, out, [&](int64_t b, int64_t v, int64_t nvb, int64_t t, const AmxRows& x,
                                            __m512 (&y)[kAmxRows]) {
    const NibbleCodes codes{NibbleCodes::of(t % kAmxChunk == 0, packed + b * kBlock * (K / 8) * 64, nvb, v, G)};
    const c10::Half* ds = dm + b * kBlock * G * kPer * kCols;
    amx_vector(G, x.q, K, codes, [&](int64_t g, const int32_t* sums, __m512 (&acc)[kAmxRows]) {
      amx_scale_min_steps(sums, g, x, [&](int64_t group) {
        const c10::Half* at = ds + (group * kPer * nvb + v) * kCols;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
        const __m512 mins = kMins ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + nvb * kCols)))
                                  : _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
        return std::pair{scale, mins};
      }, acc);
    }, y);
  });
}

// int8_linear's: D = (the sums of the codes + 128) - 128 Q (int32, exact), then int8_steps' y =
// fma(a D, s, y).
inline void int8_amx(const Rows& xs, int64_t R16, int64_t K, const uint8_t* packed, const c10::Half* scales,
                     int64_t N, c10::BFloat16* out) {
  const int64_t G = K / kGroup;
  for_each_amx_tile(xs, R16, K, N, out, [&](int64_t b, int64_t v, int64_t nvb, int64_t t, const AmxRows& x,
                                            __m512 (&y)[kAmxRows]) {
    const ByteCodes codes{packed + b * kBlock * K * kCols, nvb, v, t % kAmxChunk == 0};
    const c10::Half* ss = scales + b * kBlock * G * kCols;
    amx_vector(G, x.q, K, codes, [&](int64_t g, const int32_t* sums, __m512 (&acc)[kAmxRows]) {
      const __m512 scale = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ss + (g * nvb + v) * kCols)));
#pragma GCC unroll 16
      for (int r = 0; r < kAmxRows; ++r) {
        const __m512i D = _mm512_sub_epi32(_mm512_load_si512(sums + r * kCols),
                                           _mm512_set1_epi32(128 * x.sum[r * x.G + g]));
        const __m512 aD = _mm512_mul_ps(_mm512_cvtepi32_ps(D), _mm512_set1_ps(x.a[r * x.G + g]));
        acc[r] = _mm512_fmadd_ps(aD, scale, acc[r]);
      }
    }, y);
  });
}
