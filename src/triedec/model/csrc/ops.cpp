// The extension's operations on tensors (ops.h): each checks its inputs, allocates its output and
// runs a kernel of the loaded kernel library (kernel_table.h) on its dtype. Here too: loading that
// library.
#include "ops.h"

#include "kernel_table.h"

#include <dlfcn.h>

#include <atomic>
#include <initializer_list>
#include <mutex>

// ---- the kernel library in use --------------------------------------------------------------------

namespace {
std::atomic<const triedec::KernelTable*> active{nullptr};
std::mutex loading;
}  // namespace

namespace triedec {

const KernelTable& kernels() {
  const KernelTable* table = active.load(std::memory_order_acquire);
  TORCH_CHECK(table != nullptr, "no kernel library is loaded (triedec.model.native.load_kernel loads one)");
  return *table;
}

std::string use_kernels(const std::string& path) {
  const std::lock_guard<std::mutex> hold(loading);
  // RTLD_LOCAL: each library's symbols stay its own (every build defines the same names); a library
  // taken into use is never closed: the table it returns lives as long as the process
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "cannot load the kernel library ", path, ": ", dlerror());
  using Entry = const KernelTable* (*)();
  auto entry = reinterpret_cast<Entry>(dlsym(handle, "triedec_kernel_table"));
  if (entry == nullptr) {
    dlclose(handle);
    TORCH_CHECK(false, path, " is not a triedec kernel library");
  }
  const KernelTable* table = entry();
  if (table->version != kKernelTableVersion || std::string(table->digest) != TRIEDEC_SOURCES_DIGEST) {
    const std::string digest = table->digest;
    dlclose(handle);  // refused: nothing of it is used
    TORCH_CHECK(false, "the kernel library ", path, " was built from other sources than this extension (", digest,
                " against ", TRIEDEC_SOURCES_DIGEST, ")");
  }
  active.store(table, std::memory_order_release);
  return table->isa;
}

}  // namespace triedec

namespace {

// Runs f(T{}) with T the C++ type of a float32, bfloat16 or float16 tensor.
template <class F>
void on_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) f(float{});
  else if (dtype == at::kBFloat16) f(c10::BFloat16{});
  else f(c10::Half{});
}

void check_float_dtype(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "float32, bfloat16 or float16");
}

// ---- tree attention -----------------------------------------------------------------------------

struct Item {  // one item's checked inputs: its keys, values and key lists, and its queries' range
  torch::Tensor keys, values, off, idx;
  bool listed;
  int64_t start, T, S, KVH;
};

Item check_item(const torch::Tensor& query, int64_t start, int64_t stop, const torch::Tensor& keys,
                const torch::Tensor& values, const c10::optional<torch::Tensor>& offsets,
                const c10::optional<torch::Tensor>& indices) {
  const int64_t H = query.size(0), D = query.size(2), T = stop - start;
  TORCH_CHECK(0 <= start && start <= stop && stop <= query.size(1), "query ranges must lie within the query");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3, "keys and values must be 3-D");
  TORCH_CHECK(keys.device().is_cpu() && values.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(keys.scalar_type() == query.scalar_type() && values.scalar_type() == query.scalar_type(),
              "query, keys and values share a dtype");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "unit feature stride needed");
  const int64_t KVH = keys.size(0), S = keys.size(1);
  TORCH_CHECK(values.size(0) == KVH && values.size(1) == S && keys.size(2) == D && values.size(2) == D,
              "keys and values must be [KVH, S, D] with the query's D");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads must be a multiple of key/value heads");
  Item item{keys, values, torch::Tensor(), torch::Tensor(), offsets.has_value() && offsets->defined(), start, T, S, KVH};
  if (item.listed) {
    TORCH_CHECK(indices.has_value() && indices->defined(), "offsets need indices");
    item.off = offsets->to(torch::kLong).contiguous();
    item.idx = indices->to(torch::kInt).contiguous();
    TORCH_CHECK(item.off.dim() == 1 && item.off.size(0) == T + 1, "offsets must be [T + 1]");
    const int64_t* o = item.off.data_ptr<int64_t>();
    const int32_t* ix = item.idx.data_ptr<int32_t>();
    TORCH_CHECK(o[0] == 0 && o[T] == item.idx.numel(), "offsets must run from 0 to len(indices)");
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(o[t + 1] > o[t], "every query must see at least one key");
      for (int64_t i = o[t]; i < o[t + 1]; ++i)
        TORCH_CHECK(ix[i] >= 0 && ix[i] < S && (i == o[t] || ix[i] > ix[i - 1]), "indices must ascend within [0, S)");
    }
  } else {
    TORCH_CHECK(S > 0, "no keys");
  }
  return item;
}

torch::Tensor run_items(const torch::Tensor& query, const std::vector<Item>& items, double scale, double softcap) {
  const int64_t H = query.size(0), T = query.size(1), D = query.size(2);
  torch::Tensor out = torch::empty({T, H, D}, query.options());
  on_dtype(query.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    std::vector<triedec::AttentionProblem<scalar_t>> problems;
    for (const Item& it : items)
      problems.push_back(triedec::AttentionProblem<scalar_t>{
          query.data_ptr<scalar_t>() + it.start * query.stride(1), query.stride(0), query.stride(1),
          it.keys.data_ptr<scalar_t>(), it.keys.stride(0), it.keys.stride(1),
          it.values.data_ptr<scalar_t>(), it.values.stride(0), it.values.stride(1),
          out.data_ptr<scalar_t>() + it.start * H * D, it.T, H, H / it.KVH, D,
          it.listed ? it.off.data_ptr<int64_t>() : nullptr, it.listed ? it.idx.data_ptr<int32_t>() : nullptr, it.S,
          static_cast<float>(scale), static_cast<float>(softcap)});
    triedec::kernels().of<scalar_t>().tree_attention(problems);
  });
  return out;
}

void check_query(const torch::Tensor& query) {
  TORCH_CHECK(query.dim() == 3, "query must be 3-D");
  TORCH_CHECK(query.device().is_cpu(), "CPU tensors only");
  check_float_dtype(query.scalar_type());
  TORCH_CHECK(query.stride(2) == 1, "unit feature stride needed");
}

}  // namespace

// query [H, T, D], keys / values [KVH, S, D] (any strides, unit feature stride); the keys query t
// sees: indices[offsets[t] .. offsets[t+1]) (int32, ascending), or every slot when offsets is
// undefined. Returns [T, H, D] in the query's dtype.
torch::Tensor tree_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                             c10::optional<torch::Tensor> offsets, c10::optional<torch::Tensor> indices,
                             double scale, double softcap) {
  check_query(query);
  return run_items(query, {check_item(query, 0, query.size(1), keys, values, offsets, indices)}, scale, softcap);
}

// Several items in one call, each its own keys and values: item k's queries are query[:, bounds[k]
// .. bounds[k+1]) and see its keys / values (and key lists, as above; an undefined offsets: every
// slot). Every output equals what a call of its own gives, bit for bit. Returns [T, H, D].
torch::Tensor tree_attention_items(torch::Tensor query, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                                   std::vector<int64_t> bounds, std::vector<c10::optional<torch::Tensor>> offsets,
                                   std::vector<c10::optional<torch::Tensor>> indices, double scale, double softcap) {
  check_query(query);
  const size_t n = keys.size();
  TORCH_CHECK(values.size() == n && offsets.size() == n && indices.size() == n && bounds.size() == n + 1,
              "one keys, values, offsets and indices per item, and n + 1 bounds");
  TORCH_CHECK(n == 0 ? query.size(1) == 0 : (bounds[0] == 0 && bounds[n] == query.size(1)),
              "bounds must run from 0 to the query's length");
  std::vector<Item> items;
  for (size_t k = 0; k < n; ++k)
    items.push_back(check_item(query, bounds[k], bounds[k + 1], keys[k], values[k], offsets[k], indices[k]));
  return run_items(query, items, scale, softcap);
}

// ---- RMS norm -------------------------------------------------------------------------------------

// x [..., D] (any strides but a unit last one, rows at one stride), weight [D] in x's dtype.
// Returns a new contiguous tensor of x's shape and dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool one_plus_weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x needs a last dimension of features");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D, "weight must be [D], D = x's last dimension");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "x and weight share a dtype");
  check_float_dtype(x.scalar_type());
  torch::Tensor rows = x.reshape({-1, D});
  if (rows.stride(1) != 1) rows = rows.contiguous();
  torch::Tensor w = weight.contiguous();
  torch::Tensor out = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = rows.size(0);
  if (n == 0) return out;
  on_dtype(x.scalar_type(), [&](auto zero) {
    using scalar_t = decltype(zero);
    triedec::kernels().of<scalar_t>().rms_norm(rows.data_ptr<scalar_t>(), rows.stride(0), w.data_ptr<scalar_t>(),
                                     out.data_ptr<scalar_t>(), n, D, static_cast<float>(eps), one_plus_weight);
  });
  return out;
}

// ---- rotary ---------------------------------------------------------------------------------------

// x [B, H, T, D] (any strides but a unit last one), cos and sin [B, T, D] (the same; a unit last
// stride), all of one dtype, D even. Returns a new contiguous [B, H, T, D].
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0, "x must be [B, H, T, D] with an even D");
  TORCH_CHECK(cos.dim() == 3 && sin.sizes() == cos.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.size(2) == x.size(3), "cos and sin must be [B, T, D] for x [B, H, T, D]");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "x, cos and sin share a dtype");
  check_float_dtype(dtype);
  if (x.stride(3) != 1) x = x.contiguous();
  if (cos.stride(2) != 1) cos = cos.contiguous();
  if (sin.stride(2) != 1) sin = sin.contiguous();
  torch::Tensor out = torch::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const int64_t xs[3] = {x.stride(0), x.stride(1), x.stride(2)};
  const int64_t cs[2] = {cos.stride(0), cos.stride(1)}, ss[2] = {sin.stride(0), sin.stride(1)};
  on_dtype(dtype, [&](auto zero) {
    using scalar_t = decltype(zero);
    triedec::kernels().of<scalar_t>().rotary(x.data_ptr<scalar_t>(), xs, cos.data_ptr<scalar_t>(), cs, sin.data_ptr<scalar_t>(),
                                   ss, out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.size(3));
  });
  return out;
}

// ---- linears with 8-bit activations ---------------------------------------------------------------

namespace {

void check_input(const torch::Tensor& x, std::initializer_list<const torch::Tensor*> weights) {
  TORCH_CHECK(x.device().is_cpu(), "CPU tensors only");
  for (const torch::Tensor* w : weights) TORCH_CHECK(w->device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [R, K] bfloat16");
}

// out [R, N] bf16 from run(rows, R, out) on x's rows, made contiguous.
template <class Run>
torch::Tensor on_rows(const torch::Tensor& x, int64_t N, Run&& run) {
  torch::Tensor rows = x.contiguous();
  const int64_t R = rows.size(0);
  torch::Tensor out = torch::empty({R, N}, rows.options());
  run(rows.data_ptr<c10::BFloat16>(), R, out.data_ptr<c10::BFloat16>());
  return out;
}

}  // namespace

bool a8_linears_vectorized() { return triedec::kernels().a8_linears_vectorized(); }

namespace {

// packed: contiguous uint8 [N, K / per_byte] (N a multiple of 16, K a multiple of k_step),
// K being x's features. Returns N.
int64_t check_codes(const torch::Tensor& x, const torch::Tensor& packed, int64_t per_byte, int64_t k_step) {
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(0) % triedec::kA8Cols == 0 && (per_byte * packed.size(1)) % k_step == 0,
              "packed must be contiguous uint8 [N, K", per_byte == 1 ? "" : " / 2", "] (N a multiple of 16, K of ",
              k_step, ")");
  TORCH_CHECK(per_byte * packed.size(1) == K, "x's features must match the packed weight's");
  return packed.size(0);
}

// highs: contiguous uint8 [N, K / per_byte] (a plane of extra bits), or [N, 0] where may_be_empty.
void check_highs(const torch::Tensor& highs, int64_t N, int64_t K, int64_t per_byte, bool may_be_empty) {
  TORCH_CHECK(highs.dim() == 2 && highs.scalar_type() == at::kByte && highs.is_contiguous() && highs.size(0) == N &&
                  ((may_be_empty && highs.size(1) == 0) || per_byte * highs.size(1) == K),
              "highs must be contiguous uint8 [N, K / ", per_byte, "]", may_be_empty ? " or [N, 0]" : "");
}

// A tensor of per-block numbers: contiguous, of dtype, of exactly shape (its bytes in a8_linears.cpp's block order).
void check_blocks(const torch::Tensor& t, at::ScalarType dtype, at::IntArrayRef shape, const char* name,
                  const char* described) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.sizes() == shape, name, " must be contiguous ",
              described, " (in the kernel's block order)");
}

}  // namespace

// x [R, K] bf16; packed uint8 [N, K / 2] and scales_zeros bf16 [K / 32, 2, N] as shapes only (their
// bytes in the block order a8_linears.cpp gives). Returns [R, N] bf16.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_zeros, bool portable) {
  check_input(x, {&packed, &scales_zeros});
  const int64_t K = x.size(1), N = check_codes(x, packed, 2, triedec::kA8Group);
  check_blocks(scales_zeros, at::kBFloat16, {K / triedec::kA8Group, 2, N}, "scales_zeros", "bf16 [K / 32, 2, N]");
  return on_rows(x, N, [&](const c10::BFloat16* rows, int64_t R, c10::BFloat16* out) {
    triedec::kernels().int4_linear_rows(rows, R, K, packed.data_ptr<uint8_t>(),
                                        scales_zeros.data_ptr<c10::BFloat16>(), N, out, portable);
  });
}

// x [R, K] bf16; packed uint8 [N, K] and scales fp16 [K / 32, N] as shapes only (their bytes in the
// block order a8_linears.cpp gives). Returns [R, N] bf16.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, bool portable) {
  check_input(x, {&packed, &scales});
  const int64_t K = x.size(1), N = check_codes(x, packed, 1, triedec::kA8Group);
  check_blocks(scales, at::kHalf, {K / triedec::kA8Group, N}, "scales", "float16 [K / 32, N]");
  return on_rows(x, N, [&](const c10::BFloat16* rows, int64_t R, c10::BFloat16* out) {
    triedec::kernels().int8_linear_rows(rows, R, K, packed.data_ptr<uint8_t>(), scales.data_ptr<c10::Half>(), N,
                                        out, portable);
  });
}

// x [R, K] bf16; packed uint8 [N, K / 2] (the low 4 bits, int4's order), highs uint8 [N, K / 8] (the
// fifth bits' masks) and scales fp16 [K / 32, N] as int8's. Returns [R, N] bf16.
torch::Tensor int5_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor scales,
                          bool portable) {
  check_input(x, {&packed, &highs, &scales});
  const int64_t K = x.size(1), N = check_codes(x, packed, 2, triedec::kA8Group);
  check_highs(highs, N, K, 8, false);
  check_blocks(scales, at::kHalf, {K / triedec::kA8Group, N}, "scales", "float16 [K / 32, N]");
  return on_rows(x, N, [&](const c10::BFloat16* rows, int64_t R, c10::BFloat16* out) {
    triedec::kernels().int5_linear_rows(rows, R, K, packed.data_ptr<uint8_t>(), highs.data_ptr<uint8_t>(),
                                        scales.data_ptr<c10::Half>(), N, out, portable);
  });
}

// x [R, K] bf16; packed uint8 [N, K / 2] (the low 4 bits, int4's order), highs uint8 [N, K / 4] (bits
// 4 and 5's masks), subs int8 [K / 16, N] and supers float32 [K / 256, N] (K a multiple of 256), all
// in a8_linears.cpp's block order. Returns [R, N] bf16.
torch::Tensor int6_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor subs,
                          torch::Tensor supers, bool portable) {
  check_input(x, {&packed, &highs, &subs, &supers});
  const int64_t K = x.size(1), N = check_codes(x, packed, 2, 256);
  check_highs(highs, N, K, 4, false);
  check_blocks(subs, at::kChar, {K / 16, N}, "subs", "int8 [K / 16, N]");
  check_blocks(supers, at::kFloat, {K / 256, N}, "supers", "float32 [K / 256, N]");
  return on_rows(x, N, [&](const c10::BFloat16* rows, int64_t R, c10::BFloat16* out) {
    triedec::kernels().int6_linear_rows(rows, R, K, packed.data_ptr<uint8_t>(), highs.data_ptr<uint8_t>(),
                                        subs.data_ptr<int8_t>(), supers.data_ptr<float>(), N, out, portable);
  });
}

// x [R, K] bf16; packed uint8 [N, K / 2] (the low 4 bits, int4's order), highs uint8 [N, K / 8] (the
// fifth bits' masks: Q5_K) or [N, 0] (Q4_K), scales_mins int8 [K / 32, 2, N] and supers float32
// [K / 256, 2, N] (K a multiple of 256), all in a8_linears.cpp's block order. Returns [R, N] bf16.
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor scales_mins,
                            torch::Tensor supers, bool portable) {
  check_input(x, {&packed, &highs, &scales_mins, &supers});
  const int64_t K = x.size(1), N = check_codes(x, packed, 2, 256);
  check_highs(highs, N, K, 8, true);
  check_blocks(scales_mins, at::kChar, {K / triedec::kA8Group, 2, N}, "scales_mins", "int8 [K / 32, 2, N]");
  check_blocks(supers, at::kFloat, {K / 256, 2, N}, "supers", "float32 [K / 256, 2, N]");
  const uint8_t* fifths = highs.size(1) ? highs.data_ptr<uint8_t>() : nullptr;
  return on_rows(x, N, [&](const c10::BFloat16* rows, int64_t R, c10::BFloat16* out) {
    triedec::kernels().kquant_linear_rows(rows, R, K, packed.data_ptr<uint8_t>(), fifths,
                                          scales_mins.data_ptr<int8_t>(), supers.data_ptr<float>(), N, out, portable);
  });
}

// x [R, K] bf16; packed uint8 [N, K / 2] (the low 4 bits, int4's order), highs uint8 [N, K / 8] (the
// fifth bits' masks: Q5_1) or [N, 0] (Q4_0, Q4_1), dm fp16 [K / 32, 2, N] (d and m, in int4's order of
// scales and zeros) or, for 4-bit codes, [K / 32, 1, N] (Q4_0's d alone: m = -8 d). Returns [R, N] bf16.
torch::Tensor scale_min_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor highs, torch::Tensor dm,
                               bool portable) {
  check_input(x, {&packed, &highs, &dm});
  const int64_t K = x.size(1), N = check_codes(x, packed, 2, triedec::kA8Group);
  check_highs(highs, N, K, 8, true);
  const bool mins = !(dm.dim() == 3 && dm.size(1) == 1 && highs.size(1) == 0);
  check_blocks(dm, at::kHalf, {K / triedec::kA8Group, mins ? 2 : 1, N}, "dm",
               "float16 [K / 32, 2, N] or, with 4-bit codes, [K / 32, 1, N]");
  const uint8_t* fifths = highs.size(1) ? highs.data_ptr<uint8_t>() : nullptr;
  return on_rows(x, N, [&](const c10::BFloat16* rows, int64_t R, c10::BFloat16* out) {
    triedec::kernels().scale_min_linear_rows(rows, R, K, packed.data_ptr<uint8_t>(), fifths,
                                             dm.data_ptr<c10::Half>(), mins, N, out, portable);
  });
}

// x [R, K] float32; packed float32 [N, K] as a shape only (its values in f32_linears.cpp's block
// order), bias float32 [N] or none. Returns [R, N] float32.
torch::Tensor f32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be [R, K] float32");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  packed.size(0) % 16 == 0,
              "packed must be contiguous float32 [N, K] (N a multiple of 16)");
  const int64_t K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x's features must match the packed weight's");
  const float* b = nullptr;
  torch::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    bias_c = bias->contiguous();
    TORCH_CHECK(bias_c.device().is_cpu() && bias_c.scalar_type() == at::kFloat && bias_c.dim() == 1 &&
                    bias_c.size(0) == N, "bias must be float32 [N]");
    b = bias_c.data_ptr<float>();
  }
  torch::Tensor rows = x.contiguous();
  const int64_t R = rows.size(0);
  torch::Tensor out = torch::empty({R, N}, rows.options());
  triedec::kernels().f32_linear_rows(rows.data_ptr<float>(), R, K, packed.data_ptr<float>(), b, N,
                                     out.data_ptr<float>());
  return out;
}

int64_t dot_peak(int64_t iterations) {
  TORCH_CHECK(iterations >= 0, "iterations must not be negative");
  return triedec::kernels().dot_peak(iterations);
}

int64_t stream_read(torch::Tensor bytes) {
  TORCH_CHECK(bytes.device().is_cpu() && bytes.scalar_type() == at::kByte && bytes.is_contiguous(),
              "bytes must be a contiguous uint8 CPU tensor");
  return triedec::kernels().stream_read(bytes.data_ptr<uint8_t>(), bytes.numel());
}
