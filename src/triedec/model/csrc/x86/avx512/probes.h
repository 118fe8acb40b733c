// triedec's machine probes on AVX512-VNNI (probes.cpp): the dot-product chains and the stream
// reader. Included by probes.cpp inside its anonymous namespace.
#pragma once

int64_t dot_rounds(int64_t iterations) {
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(1);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    __asm__ volatile("" : "+v"(w));  // a new w each round: the rounds cannot be folded
  }
  __m512i s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_epi32(s, acc[i]);
  return _mm512_reduce_add_epi32(s) == 1 ? 0 : iterations * kChains * 64;
}

// The leading part of stream_read's xor of bytes [i, hi): advances i, returns the xor so far; it
// prefetches 4 KiB ahead, as the linears' tiles that stream a block do.
inline int64_t stream_xor(const uint8_t* bytes, int64_t& i, int64_t hi) {
  __m512i a = _mm512_setzero_si512(), b = a, c = a, d = a;
  for (; i + 256 <= hi; i += 256) {
    _mm_prefetch(reinterpret_cast<const char*>(bytes + i + 4096 + 0), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes + i + 4096 + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes + i + 4096 + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bytes + i + 4096 + 192), _MM_HINT_T0);
    a = _mm512_xor_si512(a, _mm512_loadu_si512(bytes + i));
    b = _mm512_xor_si512(b, _mm512_loadu_si512(bytes + i + 64));
    c = _mm512_xor_si512(c, _mm512_loadu_si512(bytes + i + 128));
    d = _mm512_xor_si512(d, _mm512_loadu_si512(bytes + i + 192));
  }
  return _mm512_reduce_add_epi64(_mm512_xor_si512(_mm512_xor_si512(a, b), _mm512_xor_si512(c, d)));
}
