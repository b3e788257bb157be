// Layers whose every routed expert runs on the CPU (no accelerator slots), by handle, and the
// `hybrid_moe::cpu_moe` op that computes their decode steps (the micro-kernels: fewer tokens than any measured GEMM
// route starts at; compile_passes/cpu_dispatch.py): at decode it is the one MoE op a token calls per layer, and
// through `hybrid_moe::dispatch` (Python: its custom_op machinery, the layer's checks and counters) it cost ~0.3 ms
// a layer over the kernel's 3 ms (benchmarks/cpu_decode_costs.py). Here the dispatcher goes straight into C++.
//
// Python publishes a layer's host expert weights under a handle whenever the handle comes to name the layer (its
// creation, a stock graph's binding: runtime/registry.py), forgets a handle bound to a layer with slots, and drops a
// layer's entries when it dies; a graph names the layer by its handle, as the dispatch op does. The op counts steps,
// tokens and active experts per layer (whatever handle ran them); Python takes the counts into the layer's
// statistics when they are read. A handle that names no published layer (a graph compiled for an all-CPU layer whose
// handle went to a layer with slots) takes the `hybrid_moe::dispatch` op instead.

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include "moe_cpu.h"

namespace {

// One layer's host experts and step counts: one entry per publishing layer (its `owner` number), named by every
// handle the layer is published under (a stock layer runs under a handle per compiled graph).
struct CpuLayer {
  int64_t owner;
  at::Tensor gate_up, down;
  c10::optional<at::Tensor> gate_up_scale, down_scale;
  std::atomic<int64_t> steps{0}, tokens{0}, experts{0};
};

struct Table {
  std::mutex mutex;
  std::unordered_map<int64_t, std::shared_ptr<CpuLayer>> by_handle, by_owner;
};

Table& table() {
  static auto* t = new Table();  // never destroyed: a graph may still run while the interpreter tears down
  return *t;
}

// The layer published under `handle`, or null.
std::shared_ptr<CpuLayer> find(int64_t handle) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  const auto it = t.by_handle.find(handle);
  return it == t.by_handle.end() ? nullptr : it->second;
}

}  // namespace

at::Tensor cpu_moe(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   int64_t layer) {
  const std::shared_ptr<CpuLayer> l = find(layer);
  if (!l) {  // the handle now names a layer with slots (or none): the general step decides, in Python
    static const auto dispatch =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("hybrid_moe::dispatch", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
    return dispatch.call(hidden, topk_ids, topk_weights, layer);
  }
  TORCH_CHECK(hidden.dim() == 2 && hidden.device().is_cpu(), "hidden must be a CPU tensor [T, H]");
  TORCH_CHECK(!at::isFloatingType(topk_ids.scalar_type()) && topk_ids.dim() == 2,
              "topk_ids must be an integer tensor [T, K]");
  TORCH_CHECK(topk_ids.device().is_cpu() && topk_weights.device().is_cpu(),
              "topk_ids and topk_weights must be on the CPU");
  const at::ScalarType wt = topk_weights.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kDouble || wt == at::kBFloat16 || wt == at::kHalf,
              "topk_weights must be a floating tensor (fp32, fp64, bf16 or fp16), got ", wt);
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t T = hidden.size(0), H = hidden.size(1), K = ids.size(1);
  TORCH_CHECK(ids.size(0) == T, "topk_ids and hidden disagree on the token count: topk_ids ", topk_ids.sizes(),
              ", hidden ", hidden.sizes());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must be [T, K] like topk_ids, got ",
              topk_weights.sizes(), " and ", topk_ids.sizes());
  // The routing weights in fp32 and the sums, in a buffer kept per thread and seen as tensors, converted and rounded
  // here: no zeros and no dtype conversions through the dispatcher (five ops a layer at decode, ~0.1 ms of self time
  // a token over 4 int4 layers on 2 cores in the profiler; benchmarks/RESULTS.md, 2026-11-29 afternoon).
  const Scratch<struct CpuMoeScratch> scratch(T * H + T * K);
  float* const sums = scratch.data();
  float* const routing = sums + T * H;
  std::fill(sums, sums + T * H, 0.f);
  const at::Tensor w = topk_weights.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "cpu_moe", [&] {
    const scalar_t* src = w.data_ptr<scalar_t>();
    for (int64_t i = 0; i < T * K; ++i) routing[i] = static_cast<float>(src[i]);
  });
  const auto as_tensor = [](float* p, at::IntArrayRef shape) {
    return at::from_blob(p, shape, at::TensorOptions().dtype(at::kFloat));
  };
  at::Tensor out_f = as_tensor(sums, {T, H});
  static const int64_t isa = best_isa();
  const int64_t active = moe_experts(hidden.contiguous(), ids, as_tensor(routing, {T, K}), l->gate_up, l->gate_up_scale,
                                     l->down, l->down_scale, isa, int64_t(1) << 62,
                                     /*gemm_kernel=*/0, out_f);
  l->steps.fetch_add(1);
  l->tokens.fetch_add(T);
  l->experts.fetch_add(active);
  at::Tensor out = at::empty(hidden.sizes(), hidden.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "cpu_moe", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    for (int64_t i = 0; i < T * H; ++i) dst[i] = static_cast<scalar_t>(sums[i]);
  });
  return out;
}

void publish_cpu_layer(int64_t handle, int64_t owner, at::Tensor gate_up, c10::optional<at::Tensor> gate_up_scale,
                       at::Tensor down, c10::optional<at::Tensor> down_scale) {
  Table& t = table();
  std::shared_ptr<CpuLayer> l;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    const auto it = t.by_owner.find(owner);
    if (it != t.by_owner.end()) l = it->second;
  }
  if (!l) {
    l = std::make_shared<CpuLayer>();
    l->owner = owner;
    l->gate_up = std::move(gate_up);
    l->gate_up_scale = std::move(gate_up_scale);
    l->down = std::move(down);
    l->down_scale = std::move(down_scale);
    // Checked once, by a step with no pairs: a misshapen layer is refused before any graph runs it.
    const int64_t H = l->down.size(1) * (l->down.dim() == 4 ? 16 : 1);  // laid-out int4: panels of 16 rows
    const at::Tensor hidden = at::zeros({1, H}, at::kFloat);
    at::Tensor scratch = at::zeros_like(hidden);
    moe_experts(hidden, at::full({1, 1}, -1, at::kLong), at::zeros({1, 1}, at::kFloat), l->gate_up, l->gate_up_scale,
                l->down, l->down_scale, best_isa(), int64_t(1) << 62, /*gemm_kernel=*/0, scratch);
  }
  std::lock_guard<std::mutex> lock(t.mutex);
  t.by_owner[owner] = l;
  t.by_handle[handle] = l;
}

void forget_cpu_handle(int64_t handle) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.by_handle.erase(handle);
}

void drop_cpu_layer(int64_t owner) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.by_owner.erase(owner);
  for (auto it = t.by_handle.begin(); it != t.by_handle.end();)
    it = it->second->owner == owner ? t.by_handle.erase(it) : std::next(it);
}

std::tuple<int64_t, int64_t, int64_t> take_cpu_layer_counts(int64_t owner) {
  std::shared_ptr<CpuLayer> l;
  {
    Table& t = table();
    std::lock_guard<std::mutex> lock(t.mutex);
    const auto it = t.by_owner.find(owner);
    if (it == t.by_owner.end()) return {0, 0, 0};
    l = it->second;
  }
  return {l->steps.exchange(0), l->tokens.exchange(0), l->experts.exchange(0)};
}
