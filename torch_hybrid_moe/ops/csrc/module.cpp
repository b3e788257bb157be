// The Python module of the CPU side: expert kernel, decode attention, the CPU-only layers' table, the CUDA
// host-function bridge.
#include "moe_cpu.h"

#include <torch/library.h>

// The ops whose schemas Python defines (ops/dense_linear.py, ops/greedy.py, ...) get their CPU kernels here: a
// compiled decode step calls them through the dispatcher straight into C++, without the Python of a
// torch.library.custom_op (~20-40 us a call).
TORCH_LIBRARY_IMPL(hybrid_moe, CPU, m) {
  m.impl("matvecs", &matvecs);
  m.impl("cpu_moe", &cpu_moe);
  m.impl("decode_attention", &decode_attention);
  m.impl("latent_attention", &latent_attention);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("greedy_tokens", &greedy_tokens);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL: a prefill's CPU share runs on a worker thread while Python queues the staging ring
  m.def("moe_experts", &moe_experts, "Accumulate routed SiLU-gated experts into an fp32 output; active experts",
        py::call_guard<py::gil_scoped_release>());
  m.def("publish_cpu_layer", &publish_cpu_layer, "Publish a layer's host experts under its handle for cpu_moe");
  m.def("forget_cpu_handle", &forget_cpu_handle, "Publish nothing under a handle (it names a layer with slots)");
  m.def("drop_cpu_layer", &drop_cpu_layer, "Drop a layer (by owner) under every handle it was published under");
  m.def("take_cpu_layer_counts", &take_cpu_layer_counts,
        "A layer's (steps, tokens, active experts) since the last take");
  m.def("dense_matvec", &dense_matvec, "Dense [N, K] weight times a few activation rows, fp32 out");
  m.def("dense_gemm", &dense_gemm, "int8 / int4 [N, K] weight times many activation rows on dequantised panels",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention_at", &decode_attention_at, "The decode_attention op's kernel at a given ISA level");
  m.def("latent_attention_at", &latent_attention_at, "The latent_attention op's kernel at a given ISA level");
  m.def("lay_out_lanes", &lay_out_lanes, "int8 rows [H, N, K] laid out for the AVX-512 lanes: (panels, scales)");
  m.def("prefill_attention_available", &prefill_attention_available,
        "Whether the prefill_attention op's kernel runs here (AVX-512 with AVX512-BF16)");
  m.def("best_isa", &best_isa, "Highest ISA level of this CPU: 0 generic, 1 AVX2 + FMA, 2 AVX-512 with VNNI");
  m.def("get_lane_start", &get_lane_start, "From how many tokens a call a level sums a format's rows as lanes");
  m.def("set_lane_start", &set_lane_start, "Set from how many tokens a call a level sums a format's rows as lanes");
  m.def("amx_available", &amx_available, "Whether the AMX GEMM kernel runs here (AMX-BF16, tile state granted)");
  bind_host_bridge(m);
}
