// triedec's machine probes on AVX2, and 256-bit vpdpbusd where the build has it (probes.cpp): the
// dot-product chains and the stream reader. Included by probes.cpp inside its anonymous namespace.
#pragma once

int64_t dot_rounds(int64_t iterations) {
  __m256i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_epi32(i);
  __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(1);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) {
#if defined(__AVXVNNI__)
      acc[i] = _mm256_dpbusd_avx_epi32(acc[i], w, x);
#elif defined(TRIEDEC_PROBE_VNNI256)
      acc[i] = _mm256_dpbusd_epi32(acc[i], w, x);
#else
      acc[i] = _mm256_add_epi16(acc[i], _mm256_maddubs_epi16(acc[i], x));
#endif
    }
    __asm__ volatile("" : "+v"(w));
  }
  __m256i s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_epi32(s, acc[i]);
  return _mm256_extract_epi32(s, 0) == 1 ? 0 : iterations * kChains * 32;
}

// The leading part of stream_read's xor of bytes [i, hi): advances i, returns the xor so far; it
// prefetches 4 KiB ahead, as the linears' tiles that stream a block do.
inline int64_t stream_xor(const uint8_t* bytes, int64_t& i, int64_t hi) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  for (; i + 128 <= hi; i += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(bytes + i + 4096 + 0), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes + i + 4096 + 64), _MM_HINT_T0);
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i + 32)));
    c = _mm256_xor_si256(c, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i + 64)));
    d = _mm256_xor_si256(d, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i + 96)));
  }
  const __m256i e = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
  return _mm256_extract_epi64(e, 0) ^ _mm256_extract_epi64(e, 3);
}
