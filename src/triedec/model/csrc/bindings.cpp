// The Python bindings of triedec's extension (setup.py builds it once, for every CPU; it runs the
// kernels of the kernel library triedec/model/native.py loads into it with use_kernels: the fastest
// ISA this CPU runs). Every kernel releases the GIL while it runs, as torch's own ops
// do: it touches no Python object.
#include "decoder.h"
#include "kernel_table.h"
#include "ops.h"

// torch/python.h (pybind11 and torch's type casters), not torch/extension.h, which adds the whole
// C++ frontend: this file compiles in about half the time.
#include <torch/python.h>

#include <ATen/Parallel.h>

#include <mutex>
#include <set>
#include <string>

namespace {

// How many threads one of the kernels' parallel loops runs on (at::parallel_for over 64 items of
// one each): torch's intra-op threads when the extension was built with OpenMP, 1 when it was not.
int64_t parallel_threads() {
  std::mutex lock;
  std::set<int> seen;
  at::parallel_for(0, 64, 1, [&](int64_t, int64_t) {
    const std::lock_guard<std::mutex> hold(lock);
    seen.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(seen.size());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("tree_attention", &tree_attention, "tree attention with a fixed reduction order", release());
  m.def("tree_attention_items", &tree_attention_items, "tree attention of several items in one call", release());
  m.def("rms_norm", &rms_norm, "RMS norm of each row, summed in a fixed order", release());
  m.def("rotary", &rotary, "rotary position embedding (rotate-half), transformers' bits", release());
  m.def("sources_digest", [] { return std::string(TRIEDEC_SOURCES_DIGEST); },
        "the digest of the sources this build was made from (triedec.model.isa.sources_digest)");
  m.def("use_kernels", &triedec::use_kernels,
        "load the kernel library at this path (checked against these sources) and run its kernels from now on; "
        "returns its instruction set");
  m.def("isa", [] { return std::string(triedec::kernels().isa); }, "the instruction set of the kernels in use");
  m.def("parallel_threads", &parallel_threads, "how many threads the kernels' parallel loops run on", release());
  m.def("a8_linears_vectorized", &a8_linears_vectorized, "whether the 8-bit-activation linears run a vector path (AVX512-VNNI or AVX2) here");
  m.def("int4_linear", &int4_linear, "a linear with 4-bit weights and 8-bit activations in its dot products",
        release());
  m.def("int8_linear", &int8_linear, "a linear with 8-bit weights and 8-bit activations in its dot products",
        release());
  m.def("int5_linear", &int5_linear,
        "a linear with 5-bit weights (a Q5_0 block's codes) and 8-bit activations in its dot products", release());
  m.def("int6_linear", &int6_linear,
        "a linear with 6-bit weights (a Q6_K block's codes and scales) and 8-bit activations in its dot products",
        release());
  m.def("kquant_linear", &kquant_linear,
        "a linear with a Q4_K or Q5_K block's codes, scales and mins and 8-bit activations in its dot products",
        release());
  m.def("scale_min_linear", &scale_min_linear,
        "a linear with a Q4_0, Q4_1 or Q5_1 block's codes, fp16 scale and min, and 8-bit activations in its dot "
        "products", release());
  m.def("f32_linear", &f32_linear, "a float32 linear, each output summed over the input features in order",
        release());
  m.def("dot_peak", &dot_peak,
        "the multiply-adds of `iterations` rounds of this build's 8-bit dot product on each thread (a probe of the peak)",
        release());
  m.def("stream_read", &stream_read, "a checksum of a uint8 tensor's bytes, read once over the threads (a probe of "
        "the memory's rate)", release());
  m.def("aten_rms_norm", &triedec::aten_rms_norm,
        "transformers' float32 RMS norm in its own torch ops, as the native forward runs it (decoder.h)");
  using triedec::NativeDecoder, triedec::NativeLayer, triedec::NativeLinear;
  // module_local: each instruction set's build registers its own classes (the tests load several in one process)
  pybind11::class_<NativeLinear>(m, "NativeLinear", pybind11::module_local(),
                                 "one linear: kind, packed codes, scales, bias, input features (decoder.h)")
      .def(pybind11::init<std::string, torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>())
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<int64_t>, bool, c10::optional<torch::Tensor>,
                          int64_t>());
  pybind11::class_<NativeLayer>(m, "NativeLayer", pybind11::module_local(), "one decoder layer's weights (decoder.h)")
      .def(pybind11::init<c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, std::vector<NativeLinear>,
                          NativeLinear, std::vector<NativeLinear>, NativeLinear, c10::optional<torch::Tensor>,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                          int64_t, bool>());
  pybind11::class_<NativeDecoder>(m, "NativeDecoder", pybind11::module_local(),
                                  "a Llama-family or Gemma 3 decoder's forward in one call (decoder.h)")
      .def(pybind11::init<std::vector<NativeLayer>, torch::Tensor, NativeLinear, int64_t, int64_t, int64_t, double,
                          double, bool, bool, double, double, bool, int64_t>())
      .def("forward", &NativeDecoder::forward, release())
      .def_property_readonly("layers", &NativeDecoder::layers);
}
