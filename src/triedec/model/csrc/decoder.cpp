// triedec's native forward of a Llama-family or Gemma 3 decoder (decoder.h). Per layer, in the
// order transformers' LlamaDecoderLayer / Gemma3DecoderLayer runs it and triedec/model/runner.py's
// Python walk calls it:
//   x = rms_norm(h); q | k | v = x Wqkv (+ b); [Gemma: q, k = q_norm(q), k_norm(k) per head];
//   q, k = rotary(q), rotary(k) (the layer kind's table); K/V into each item's cache;
//   a = tree_attention(q, cache) (the layer kind's key lists); y = a Wo; [Gemma: y = rms_norm(y)];
//   h = h + y; x = rms_norm(h); g | u = x Wgu; y = (act(g) * u) Wd; [Gemma: y = rms_norm(y)]; h = h + y
// then the final norm and the LM head on the kept rows. act is torch's silu or tanh-gelu. Every step
// is the kernel or the one IEEE operation per element that the Python walk runs (the residual adds
// and the product act(g) * u are one float32 operation rounded to bfloat16, as torch's bfloat16 ops
// are; the activation is torch's own op), so the logits are the same bits (tests/test_runner.py).
// Rows depend on their own inputs only: every kernel computes a row alone, and attention reads the
// slots a row sees.
#include "decoder.h"

#include "kernel_table.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>

#include <algorithm>
#include <cstring>

namespace triedec {

namespace {

using bf16 = c10::BFloat16;

void check_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16 && t.is_contiguous(), what,
              " must be a contiguous bfloat16 CPU tensor");
}

// rows [R, K] W^T as the torch op a mode's stand-in calls gives it: int8's or int4's weight-only op
// (no bias), or oneDNN's pre-packed linear as PackedLinear.rows (the bias in the op) or
// SplitLinear.rows (the pieces' outputs added in order, then the bias).
at::Tensor torch_linear(const NativeLinear& l, const at::Tensor& rows) {
  if (l.kind == NativeLinear::kInt8) return at::_weight_int8pack_mm(rows, l.packed, l.scales);
  if (l.kind == NativeLinear::kInt4) return at::_weight_int4pack_mm_for_cpu(rows, l.packed, kA8Group, l.scales);
  static const auto op = c10::Dispatcher::singleton()
      .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                        c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  const auto call = [](const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
    return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::string_view(""));
  };
  if (!l.split) return call(rows, l.pieces[0], l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt);
  at::Tensor y;
  for (size_t i = 0; i < l.pieces.size(); ++i) {
    const at::Tensor piece = call(rows.narrow(1, l.bounds[i], l.bounds[i + 1] - l.bounds[i]), l.pieces[i], c10::nullopt);
    y = i == 0 ? piece : at::add(y, piece);
  }
  return l.bias.defined() ? at::add(y, l.bias) : y;
}

// out [R, N] = x [R, K] W^T (+ bias), as the linear's own op gives it: triedec's kernel, or the
// torch op the mode's stand-in calls (on the same rows, so the same bits), its result copied out.
void run_linear(const NativeLinear& l, const bf16* x, int64_t R, bf16* out) {
  const KernelTable& kern = kernels();
  if (l.kind == NativeLinear::kA8Int4) {
    kern.int4_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(), l.scales.data_ptr<bf16>(), l.N, out, false);
  } else if (l.kind == NativeLinear::kA8Int8) {
    kern.int8_linear_rows(x, R, l.K, l.packed.data_ptr<uint8_t>(), l.scales.data_ptr<c10::Half>(), l.N, out, false);
  } else {
    const at::Tensor y = torch_linear(l, at::from_blob(const_cast<bf16*>(x), {R, l.K},
                                                       at::TensorOptions().dtype(at::kBFloat16)));
    TORCH_CHECK(y.is_contiguous() && y.size(0) == R && y.size(1) == l.N, "a linear's torch op returned another shape");
    std::memcpy(out, y.data_ptr<bf16>(), R * l.N * sizeof(bf16));
    if (l.kind == NativeLinear::kOneDnn) return;  // its bias is in y
  }
  if (l.bias.defined()) kern.add_bias_bf16(out, l.bias.data_ptr<bf16>(), R, l.N);
}

// The parts' outputs side by side in out [R, width]: one linear writes out directly; several are
// each computed alone (their own bits) and copied into their columns.
void run_parts(const std::vector<NativeLinear>& parts, const bf16* x, int64_t R, bf16* out, int64_t width) {
  if (parts.size() == 1) {
    run_linear(parts[0], x, R, out);
    return;
  }
  int64_t at = 0;
  for (const NativeLinear& l : parts) {
    at::Tensor part = at::empty({R, l.N}, at::kBFloat16);
    run_linear(l, x, R, part.data_ptr<bf16>());
    const bf16* p = part.data_ptr<bf16>();
    for (int64_t r = 0; r < R; ++r) std::memcpy(out + r * width + at, p + r * l.N, l.N * sizeof(bf16));
    at += l.N;
  }
}

int64_t total_out(const std::vector<NativeLinear>& parts) {
  int64_t n = 0;
  for (const NativeLinear& l : parts) n += l.N;
  return n;
}

NativeLinear::Kind linear_kind(const std::string& kind) {
  if (kind == "a8-int4") return NativeLinear::kA8Int4;
  if (kind == "a8-int8") return NativeLinear::kA8Int8;
  if (kind == "int8") return NativeLinear::kInt8;
  TORCH_CHECK(kind == "int4", "a linear's kind is a8-int4, a8-int8, int8 or int4, not ", kind);
  return NativeLinear::kInt4;
}

}  // namespace

NativeLinear::NativeLinear(const std::string& kind_, at::Tensor packed_, at::Tensor scales_,
                           c10::optional<at::Tensor> bias_, int64_t in_features)
    : kind(linear_kind(kind_)), packed(std::move(packed_)), scales(std::move(scales_)),
      bias(bias_.value_or(at::Tensor())), K(in_features) {
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.scalar_type() == (kind == kInt8 ? at::kChar : at::kByte),
              "packed codes must be a contiguous 2-D CPU tensor (int8 for int8, else uint8)");
  N = packed.size(0);
  TORCH_CHECK(K > 0 && K % kA8Group == 0, "input features must be a multiple of 32");
  TORCH_CHECK(packed.size(1) == ((kind == kA8Int4 || kind == kInt4) ? K / 2 : K), "packed codes must be [N, K] (4-bit: [N, K / 2])");
  TORCH_CHECK(scales.device().is_cpu() && scales.is_contiguous(), "scales must be contiguous");
  switch (kind) {
    case kA8Int4:
      TORCH_CHECK(N % kA8Cols == 0, "output features must be a multiple of 16");
      TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(0) == K / kA8Group &&
                      scales.size(1) == 2 && scales.size(2) == N, "scales_zeros must be bf16 [K / 32, 2, N]");
      break;
    case kA8Int8:
      TORCH_CHECK(N % kA8Cols == 0, "output features must be a multiple of 16");
      TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == K / kA8Group &&
                      scales.size(1) == N, "scales must be fp16 [K / 32, N]");
      break;
    case kInt8:
      TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 1 && scales.size(0) == N,
                  "an int8 linear's scale must be bf16 [N]");
      break;
    case kInt4:
      TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(0) == K / kA8Group &&
                      scales.size(1) == N && scales.size(2) == 2, "scales_and_zeros must be bf16 [K / 32, N, 2]");
      break;
  }
  if (bias.defined()) {
    check_bf16(bias, "bias");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "bias must be [N]");
  }
}

NativeLinear::NativeLinear(std::vector<at::Tensor> pieces_, std::vector<int64_t> bounds_, bool split_,
                           c10::optional<at::Tensor> bias_, int64_t out_features)
    : kind(kOneDnn), bias(bias_.value_or(at::Tensor())), pieces(std::move(pieces_)), bounds(std::move(bounds_)),
      split(split_), N(out_features) {
  TORCH_CHECK(!pieces.empty() && bounds.size() == pieces.size() + 1 && bounds[0] == 0 && (split || pieces.size() == 1),
              "a oneDNN linear needs its pieces and their bounds (one piece unless split)");
  for (size_t i = 0; i < pieces.size(); ++i)
    TORCH_CHECK(bounds[i + 1] > bounds[i] && pieces[i].device().is_cpu() && pieces[i].scalar_type() == at::kBFloat16,
                "pieces must be bf16 CPU weights over ascending bounds");
  K = bounds.back();
  TORCH_CHECK(N > 0, "output features must be positive");
  if (bias.defined()) {
    check_bf16(bias, "bias");
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == N, "bias must be [N]");
  }
}

NativeLayer::NativeLayer(at::Tensor input_norm_, at::Tensor post_norm_, std::vector<NativeLinear> qkv_,
                         NativeLinear o_, std::vector<NativeLinear> gate_up_, NativeLinear down_,
                         c10::optional<at::Tensor> attn_out_norm_, c10::optional<at::Tensor> mlp_out_norm_,
                         c10::optional<at::Tensor> q_norm_, c10::optional<at::Tensor> k_norm_, int64_t kind_)
    : input_norm(std::move(input_norm_)), post_norm(std::move(post_norm_)), qkv(std::move(qkv_)), o(std::move(o_)),
      gate_up(std::move(gate_up_)), down(std::move(down_)), attn_out_norm(attn_out_norm_.value_or(at::Tensor())),
      mlp_out_norm(mlp_out_norm_.value_or(at::Tensor())), q_norm(q_norm_.value_or(at::Tensor())),
      k_norm(k_norm_.value_or(at::Tensor())), kind(kind_) {
  check_bf16(input_norm, "input_norm");
  check_bf16(post_norm, "post_norm");
  for (const at::Tensor* t : {&attn_out_norm, &mlp_out_norm, &q_norm, &k_norm})
    if (t->defined()) check_bf16(*t, "a norm weight");
  TORCH_CHECK(attn_out_norm.defined() == mlp_out_norm.defined(), "the output norms come together");
  TORCH_CHECK(q_norm.defined() == k_norm.defined(), "the q and k norms come together");
  TORCH_CHECK(kind >= 0, "a layer's kind is an index");
  TORCH_CHECK(!qkv.empty() && !gate_up.empty(), "q/k/v and gate/up need at least one linear each");
}

NativeDecoder::NativeDecoder(std::vector<NativeLayer> layers, at::Tensor norm, NativeLinear head, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, double eps, double scale, bool one_plus, bool gelu)
    : layers_(std::move(layers)), norm_(std::move(norm)), head_(std::move(head)), H_(heads), KVH_(kv_heads),
      hd_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)), one_plus_(one_plus),
      gelu_(gelu) {
  TORCH_CHECK(!layers_.empty(), "a decoder needs layers");
  TORCH_CHECK(H_ > 0 && KVH_ > 0 && H_ % KVH_ == 0 && hd_ > 0 && hd_ % 2 == 0,
              "heads must be a multiple of kv_heads, head_dim even");
  check_bf16(norm_, "norm");
  D_ = norm_.size(0);
  qkv_width_ = (H_ + 2 * KVH_) * hd_;
  I_ = total_out(layers_[0].gate_up) / 2;
  qk_norms_ = layers_[0].q_norm.defined();
  kinds_ = 0;
  for (const NativeLayer& l : layers_) {
    TORCH_CHECK(l.input_norm.numel() == D_ && l.post_norm.numel() == D_, "norm weights must be [D]");
    TORCH_CHECK(!l.attn_out_norm.defined() || (l.attn_out_norm.numel() == D_ && l.mlp_out_norm.numel() == D_),
                "output norm weights must be [D]");
    TORCH_CHECK(l.q_norm.defined() == qk_norms_, "every layer has q/k norms or none does");
    TORCH_CHECK(l.attn_out_norm.defined() == layers_[0].attn_out_norm.defined(),
                "every layer has output norms or none does");
    TORCH_CHECK(!qk_norms_ || (l.q_norm.numel() == hd_ && l.k_norm.numel() == hd_), "q/k norm weights must be [head_dim]");
    TORCH_CHECK(total_out(l.qkv) == qkv_width_, "q | k | v must give (heads + 2 kv_heads) * head_dim outputs");
    TORCH_CHECK(total_out(l.gate_up) == 2 * I_, "every layer's gate | up must be 2 * intermediate");
    for (const NativeLinear& p : l.qkv) TORCH_CHECK(p.K == D_, "q/k/v take the hidden size");
    for (const NativeLinear& p : l.gate_up) TORCH_CHECK(p.K == D_, "gate/up take the hidden size");
    TORCH_CHECK(l.o.K == H_ * hd_ && l.o.N == D_, "o maps heads * head_dim to the hidden size");
    TORCH_CHECK(l.down.K == I_ && l.down.N == D_, "down maps the intermediate size to the hidden size");
    kinds_ = std::max(kinds_, l.kind + 1);
  }
  TORCH_CHECK(head_.K == D_, "the head takes the hidden size");
}

at::Tensor NativeDecoder::forward(const at::Tensor& hidden, const std::vector<at::Tensor>& cos,
                                  const std::vector<at::Tensor>& sin, const std::vector<int64_t>& bounds,
                                  const std::vector<int64_t>& lengths,
                                  const std::vector<std::vector<at::Tensor>>& keys,
                                  const std::vector<std::vector<at::Tensor>>& values,
                                  const std::vector<std::vector<c10::optional<at::Tensor>>>& offsets,
                                  const std::vector<std::vector<c10::optional<at::Tensor>>>& indices,
                                  const c10::optional<at::Tensor>& keep) const {
  check_bf16(hidden, "hidden");
  const int64_t N = hidden.size(0), L = layers();
  TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == D_, "hidden must be [N, D]");
  TORCH_CHECK(static_cast<int64_t>(cos.size()) == kinds_ && static_cast<int64_t>(sin.size()) == kinds_ &&
                  static_cast<int64_t>(offsets.size()) == kinds_ && static_cast<int64_t>(indices.size()) == kinds_,
              "one rotary table and one set of key lists per kind of layer");
  for (int64_t j = 0; j < kinds_; ++j) {
    check_bf16(cos[j], "cos");
    check_bf16(sin[j], "sin");
    TORCH_CHECK(cos[j].dim() == 2 && cos[j].size(0) == N && cos[j].size(1) == hd_ && sin[j].sizes() == cos[j].sizes(),
                "cos and sin must be [N, head_dim]");
  }
  const size_t items = lengths.size();
  TORCH_CHECK(items > 0 && bounds.size() == items + 1 && keys.size() == items && values.size() == items,
              "one length, keys and values per item");
  for (int64_t j = 0; j < kinds_; ++j)
    TORCH_CHECK(offsets[j].size() == items && indices[j].size() == items, "one key list per item and kind");
  TORCH_CHECK(bounds[0] == 0 && bounds[items] == N, "bounds must run from 0 to N");
  // Each item's caches and key lists, checked once for the whole forward.
  std::vector<int64_t> capacity(items);
  std::vector<std::vector<at::Tensor>> off(kinds_, std::vector<at::Tensor>(items)), idx(off);
  for (size_t k = 0; k < items; ++k) {
    const int64_t T = bounds[k + 1] - bounds[k];
    TORCH_CHECK(T > 0, "every item needs tokens");
    TORCH_CHECK(static_cast<int64_t>(keys[k].size()) == L && static_cast<int64_t>(values[k].size()) == L,
                "one K and V buffer per layer");
    const at::Tensor& first = keys[k][0];
    TORCH_CHECK(first.dim() == 4, "caches must be [1, kv_heads, capacity, head_dim]");
    capacity[k] = first.size(2);
    TORCH_CHECK(lengths[k] >= 0 && lengths[k] + T <= capacity[k], "the new tokens must fit in the cache");
    for (int64_t l = 0; l < L; ++l)
      for (const at::Tensor* buf : {&keys[k][l], &values[k][l]}) {
        check_bf16(*buf, "a cache buffer");
        TORCH_CHECK(buf->dim() == 4 && buf->size(0) == 1 && buf->size(1) == KVH_ && buf->size(2) == capacity[k] &&
                        buf->size(3) == hd_, "caches must be [1, kv_heads, capacity, head_dim]");
      }
    const int64_t S = lengths[k] + T;
    for (int64_t j = 0; j < kinds_; ++j) {
      if (!offsets[j][k].has_value() || !offsets[j][k]->defined()) continue;
      TORCH_CHECK(indices[j][k].has_value() && indices[j][k]->defined(), "offsets need indices");
      off[j][k] = offsets[j][k]->to(at::kLong).contiguous();
      idx[j][k] = indices[j][k]->to(at::kInt).contiguous();
      TORCH_CHECK(off[j][k].dim() == 1 && off[j][k].size(0) == T + 1, "offsets must be [T + 1]");
      const int64_t* o = off[j][k].data_ptr<int64_t>();
      const int32_t* ix = idx[j][k].data_ptr<int32_t>();
      TORCH_CHECK(o[0] == 0 && o[T] == idx[j][k].numel(), "offsets must run from 0 to len(indices)");
      for (int64_t t = 0; t < T; ++t) {
        TORCH_CHECK(o[t + 1] > o[t], "every query must see at least one key");
        for (int64_t i = o[t]; i < o[t + 1]; ++i)
          TORCH_CHECK(ix[i] >= 0 && ix[i] < S && (i == o[t] || ix[i] > ix[i - 1]), "indices must ascend within [0, S)");
      }
    }
  }
  at::Tensor rows;
  if (keep.has_value() && keep->defined()) {
    rows = keep->to(at::kLong).contiguous();
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.numel(); ++i) TORCH_CHECK(r[i] >= 0 && r[i] < N, "keep rows must lie in [0, N)");
  }

  const auto opts = hidden.options();
  at::Tensor h = hidden.clone();
  at::Tensor x = at::empty({N, D_}, opts), qkv = at::empty({N, qkv_width_}, opts);
  at::Tensor q = at::empty({H_, N, hd_}, opts), kr = at::empty({KVH_, N, hd_}, opts);
  at::Tensor att = at::empty({N, H_, hd_}, opts), y = at::empty({N, D_}, opts);
  at::Tensor gu = at::empty({N, 2 * I_}, opts), prod = at::empty({N, I_}, opts);
  // Gemma's q / k norms: each head's slice gathered into [N * heads, head_dim], then normed
  at::Tensor gathered, qn, kn;
  if (qk_norms_) {
    gathered = at::empty({N * H_, hd_}, opts);
    qn = at::empty({N * H_, hd_}, opts);
    kn = at::empty({N * KVH_, hd_}, opts);
  }
  at::Tensor y2 = (layers_[0].attn_out_norm.defined()) ? at::empty({N, D_}, opts) : at::Tensor();
  bf16 *hp = h.data_ptr<bf16>(), *xp = x.data_ptr<bf16>(), *qkvp = qkv.data_ptr<bf16>();
  bf16 *qp = q.data_ptr<bf16>(), *kp = kr.data_ptr<bf16>(), *ap = att.data_ptr<bf16>(), *yp = y.data_ptr<bf16>();
  bf16 *gup = gu.data_ptr<bf16>(), *pp = prod.data_ptr<bf16>();
  bf16* y2p = y2.defined() ? y2.data_ptr<bf16>() : nullptr;
  const KernelTable& kern = kernels();
  // h += y, a sublayer's output in y, through the layer's norm on that output first where it has
  // one (Gemma 3's post-attention and post-feedforward norms)
  const auto add_output = [&](const at::Tensor& norm) {
    if (!norm.defined()) {
      kern.add_bf16(hp, yp, N * D_);
      return;
    }
    kern.bf16.rms_norm(yp, D_, norm.data_ptr<bf16>(), y2p, N, D_, eps_, one_plus_);
    kern.add_bf16(hp, y2p, N * D_);
  };
  const int64_t W = qkv_width_, q_end = H_ * hd_, k_end = (H_ + KVH_) * hd_;
  const int64_t q_strides[3] = {0, hd_, W}, rope_strides[2] = {0, hd_};
  const int64_t qn_strides[3] = {0, hd_, H_ * hd_}, kn_strides[3] = {0, hd_, KVH_ * hd_};

  for (int64_t l = 0; l < L; ++l) {
    const NativeLayer& layer = layers_[l];
    const bf16 *cp = cos[layer.kind].data_ptr<bf16>(), *sp = sin[layer.kind].data_ptr<bf16>();
    kern.bf16.rms_norm(hp, D_, layer.input_norm.data_ptr<bf16>(), xp, N, D_, eps_, one_plus_);
    run_parts(layer.qkv, xp, N, qkvp, W);
    if (qk_norms_) {
      bf16* gp = gathered.data_ptr<bf16>();
      for (int64_t r = 0; r < N; ++r) std::memcpy(gp + r * q_end, qkvp + r * W, q_end * sizeof(bf16));
      kern.bf16.rms_norm(gp, hd_, layer.q_norm.data_ptr<bf16>(), qn.data_ptr<bf16>(), N * H_, hd_, eps_, one_plus_);
      for (int64_t r = 0; r < N; ++r)
        std::memcpy(gp + r * KVH_ * hd_, qkvp + r * W + q_end, KVH_ * hd_ * sizeof(bf16));
      kern.bf16.rms_norm(gp, hd_, layer.k_norm.data_ptr<bf16>(), kn.data_ptr<bf16>(), N * KVH_, hd_, eps_,
                          one_plus_);
      kern.bf16.rotary(qn.data_ptr<bf16>(), qn_strides, cp, rope_strides, sp, rope_strides, qp, 1, H_, N, hd_);
      kern.bf16.rotary(kn.data_ptr<bf16>(), kn_strides, cp, rope_strides, sp, rope_strides, kp, 1, KVH_, N, hd_);
    } else {
      kern.bf16.rotary(qkvp, q_strides, cp, rope_strides, sp, rope_strides, qp, 1, H_, N, hd_);
      kern.bf16.rotary(qkvp + q_end, q_strides, cp, rope_strides, sp, rope_strides, kp, 1, KVH_, N, hd_);
    }
    std::vector<AttentionProblem<bf16>> problems;
    const std::vector<at::Tensor>&koff = off[layer.kind], &kidx = idx[layer.kind];
    for (size_t k = 0; k < items; ++k) {
      const int64_t start = bounds[k], T = bounds[k + 1] - start, len = lengths[k], cap = capacity[k];
      bf16* kb = keys[k][l].data_ptr<bf16>();
      bf16* vb = values[k][l].data_ptr<bf16>();
      for (int64_t g = 0; g < KVH_; ++g)
        for (int64_t t = 0; t < T; ++t) {
          std::memcpy(kb + (g * cap + len + t) * hd_, kp + (g * N + start + t) * hd_, hd_ * sizeof(bf16));
          std::memcpy(vb + (g * cap + len + t) * hd_, qkvp + (start + t) * W + k_end + g * hd_, hd_ * sizeof(bf16));
        }
      const bool listed = koff[k].defined();
      problems.push_back(AttentionProblem<bf16>{
          qp + start * hd_, N * hd_, hd_, kb, cap * hd_, hd_, vb, cap * hd_, hd_, ap + start * H_ * hd_, T, H_,
          H_ / KVH_, hd_, listed ? koff[k].data_ptr<int64_t>() : nullptr,
          listed ? kidx[k].data_ptr<int32_t>() : nullptr, len + T, scale_, 0.0f});
    }
    kern.bf16.tree_attention(problems);
    run_linear(layer.o, ap, N, yp);
    add_output(layer.attn_out_norm);
    kern.bf16.rms_norm(hp, D_, layer.post_norm.data_ptr<bf16>(), xp, N, D_, eps_, one_plus_);
    run_parts(layer.gate_up, xp, N, gup, 2 * I_);
    const at::Tensor gate = gu.narrow(1, 0, I_).contiguous();
    const at::Tensor act = gelu_ ? at::gelu(gate, "tanh") : at::silu(gate);
    const bf16* actp = act.data_ptr<bf16>();
    kern.mul_bf16_rows(actp, I_, gup + I_, 2 * I_, pp, N, I_);
    run_linear(layer.down, pp, N, yp);
    add_output(layer.mlp_out_norm);
  }
  // The final norm and the head on the kept rows only (a row's norm is its own).
  const int64_t R = rows.defined() ? rows.numel() : N;
  at::Tensor kept = h;
  if (rows.defined()) {
    kept = at::empty({R, D_}, opts);
    const int64_t* r = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < R; ++i)
      std::memcpy(kept.data_ptr<bf16>() + i * D_, hp + r[i] * D_, D_ * sizeof(bf16));
  }
  at::Tensor normed = at::empty({R, D_}, opts);
  kern.bf16.rms_norm(kept.data_ptr<bf16>(), D_, norm_.data_ptr<bf16>(), normed.data_ptr<bf16>(), R, D_, eps_,
                      one_plus_);
  at::Tensor logits = at::empty({R, head_.N}, opts);
  run_linear(head_, normed.data_ptr<bf16>(), R, logits.data_ptr<bf16>());
  return logits;
}

}  // namespace triedec
