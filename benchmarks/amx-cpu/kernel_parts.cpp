// The AMX kernel of the default model's gate/up shape (Q4_1, 3072 x 576, 64 rows, 1 thread) called
// directly, against the build's dispatch (kernel_parts.sh builds it with parts of the kernel skipped).
#include "a8_linears.cpp"
#include <chrono>
#include <cstdio>
#include <random>
int main(int argc, char** argv) {
  const int64_t R = 64, K = 576, N = 3072, G = K / 32;
  std::mt19937 rng(1);
  std::vector<c10::BFloat16> x(R * K);
  for (auto& v : x) v = c10::BFloat16(std::normal_distribution<float>()(rng));
  std::vector<uint8_t> packed(N * K / 2);
  for (auto& b : packed) b = rng() & 0xFF;
  std::vector<c10::Half> dm(N * G * 2);
  for (auto& h : dm) h = c10::Half(std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng));
  std::vector<c10::BFloat16> out(R * N);
  at::set_num_threads(1);
  if (!amx_granted()) return 1;
  const Rows& xs = quantize_rows(x.data(), R, K, false);
  for (int mode = 0; mode < 2; ++mode) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < 300; ++i) {
        if (mode == 0) scale_min_amx<true>(xs, R, K, packed.data(), dm.data(), N, out.data());
        else scale_min_vector(xs, R, K, packed.data(), nullptr, dm.data(), true, N, out.data());
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 300);
    }
    const double units = R / 16.0 * N / 16.0 * G;
    std::printf("%s %.3f ms %.1f ns/unit\n", mode == 0 ? "amx-direct" : "vector(dispatch)", best * 1e3, best / units * 1e9);
  }
}
