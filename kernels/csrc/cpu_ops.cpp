// The native CPU library's Python module: every op's binding, in one place (kernels/native.py builds
// this file with the per-op .cpp files beside it into one library; cpu_ops.h declares what they share).

#include <torch/extension.h>

#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  using namespace cpu_ops;
  module.def("q4_matmul", &q4_matmul,
             "x [M, K] bfloat16 (float32) @ Q4_1 codes in the native layout -> [M, N] bfloat16 (float32)",
             pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("d"), pybind11::arg("m"),
             pybind11::arg("bits") = 0);
  module.def("q8_matmul", &q8_matmul, "x [M, K] @ Q8_0 codes [N, K] (d [N, K/32]) -> [M, N] float32");
  module.def("q8_matmul_i16", &q8_matmul_i16,
             "float32 x [M, K] rounded to 16 bits per block of 32 @ Q8_0 codes in the tile layout -> [M, n] float32");
  module.def("greedy_verify", &greedy_verify, "argmax of every row of CPU float32 logits and the accepted prefix");
  module.def("race_candidates", &race_candidates,
             "per row, the one column that can win its exponential race, or the candidates where several can",
             pybind11::arg("probs"), pybind11::arg("keys"), pybind11::arg("ids") = pybind11::none());
  module.def("silu_mul", &silu_mul, "silu(gate) * up of float32 gate_up [..., 2 I] (gate, then up) -> [..., I]");
  module.def("rms_norm", &rms_norm_rows,
             "RMS norm of bfloat16 or float32 rows, normalised in float32 (each row on its own)");
  pybind11::class_<LayerStack>(module, "LayerStack", "Llama decoder layers in one parallel region per forward")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, double, int64_t, int64_t, int64_t, double,
                          std::vector<int64_t>, int64_t>())
      .def("forward", &LayerStack::forward);
  module.def("attention", &attention, "RoPE, the cache write and attention over each row's own keys, for one layer");
  module.def("set_attention_groups", &set_attention_groups,
             "whether query heads that share a kv head run together (the same bits; off only to time it)");
  module.def("attention_groups", &attention_groups, "whether query heads that share a kv head run together");
  module.def("has_avx2_fma", &has_avx2_fma, "whether float32 activations take the native 4-bit and 8-bit paths");
  module.def("has_avx512", &has_avx512, "whether the AVX-512 paths run on this CPU");
  module.def("has_avx512_bf16", &has_avx512_bf16, "whether bfloat16 activations take the dot-product path");
  module.def("has_avx512_vnni", &has_avx512_vnni, "whether 8-bit activations can take the integer dot-product path");
}
