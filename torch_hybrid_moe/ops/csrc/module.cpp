// The Python module of the CPU side: expert kernel plus the CUDA host-function bridge.
#include "moe_cpu.h"

#include <torch/library.h>

// The ops whose schemas Python defines (ops/dense_linear.py) get their CPU kernels here: a compiled decode step calls
// them through the dispatcher straight into C++, without the Python of a torch.library.custom_op (~20-40 us a call).
TORCH_LIBRARY_IMPL(hybrid_moe, CPU, m) { m.impl("matvecs", &matvecs); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts", &moe_experts, "Accumulate routed SiLU-gated experts into an fp32 output");
  m.def("dense_matvec", &dense_matvec, "Dense [N, K] weight times a few activation rows, fp32 out");
  m.def("best_isa", &best_isa, "Highest ISA level of this CPU: 0 generic, 1 AVX2 + FMA, 2 AVX-512 with VNNI");
  bind_host_bridge(m);
}
