// The machine's limits, measured with the kernels' own instructions (scripts/roofline.py): the
// peak rate of the 8-bit dot products the linears issue, and the rate at which a kernel streams
// bytes from memory. Each runs on torch's intra-op threads, one share per thread, and returns a
// count the caller divides by the time it took; the results feed no computation.
//
// dot_peak: each thread runs `iterations` rounds of 12 independent accumulator chains (enough to
// cover the instruction's latency on two ports) of this build's 8-bit dot product: AVX512-VNNI's
// vpdpbusd on 512 bits (64 multiply-adds), AVX-VNNI's on 256 (32), AVX2's vpmaddubsw (32) with the
// vpaddw that sums it into int16 (int4's step), or a scalar loop. Returns the multiply-adds done in
// all. On AVX2 each chain multiplies its own accumulator's bytes: with one shared pair of operands
// the compiler computes the product once a round for all 12 chains (it did, and the probe timed
// twelve adds).
// stream_read: the bytes [0, n) read once, split over the threads, with the widest loads this
// build has; returns a checksum (so that the loads are not optimized away).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(TRIEDEC_VNNI256_EVEX)
#include <immintrin.h>
#define TRIEDEC_PROBE_VNNI512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define TRIEDEC_PROBE_AVX2 1
#if defined(__AVXVNNI__) || (defined(TRIEDEC_VNNI256_EVEX) && defined(__AVX512VNNI__) && defined(__AVX512VL__))
#define TRIEDEC_PROBE_VNNI256 1
#endif
#endif

namespace {

constexpr int kChains = 12;

#if defined(TRIEDEC_PROBE_VNNI512)
#include "x86/avx512/probes.h"
#elif defined(TRIEDEC_PROBE_AVX2)
#include "x86/avx2/probes.h"
#else
int64_t dot_rounds(int64_t iterations) {
  int32_t acc[kChains * 4];
  for (int i = 0; i < kChains * 4; ++i) acc[i] = i;
  volatile uint8_t w_source = 3;
  uint8_t w = w_source;
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains * 4; ++i) acc[i] += static_cast<int32_t>(w) * static_cast<int8_t>(1 + (i & 1));
    __asm__ volatile("" : "+r"(w));
  }
  int32_t s = 0;
  for (int i = 0; i < kChains * 4; ++i) s += acc[i];
  return s == 1 ? 0 : iterations * kChains * 4;
}

inline int64_t stream_xor(const uint8_t*, int64_t&, int64_t) { return 0; }
#endif

}  // namespace

namespace triedec {

int64_t dot_peak(int64_t iterations) {
  std::atomic<int64_t> done{0};
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) done += dot_rounds(iterations);
  });
  return done.load();
}

int64_t stream_read(const uint8_t* bytes, int64_t n) {
  std::atomic<int64_t> total{0};
  constexpr int64_t kPiece = 1 << 20;
  at::parallel_for(0, (n + kPiece - 1) / kPiece, 1, [&](int64_t begin, int64_t end) {
    const int64_t lo = begin * kPiece, hi = std::min(n, end * kPiece);
    int64_t i = lo;
    int64_t sum = stream_xor(bytes, i, hi);
    for (; i + 8 <= hi; i += 8) {
      int64_t word;
      std::memcpy(&word, bytes + i, 8);
      sum ^= word;
    }
    for (; i < hi; ++i) sum ^= bytes[i];
    total += sum;
  });
  return total.load();
}

}  // namespace triedec
