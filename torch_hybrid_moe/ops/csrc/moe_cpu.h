// The CPU expert kernel's entry points, shared by its Python binding and the CUDA host-function bridge.
#pragma once

#include <memory>
#include <string>

#include <torch/extension.h>

// A calling thread's fp32 buffer of at least n floats, uninitialised, kept from one call to the next (allocated anew,
// moe_experts' buffers cost page faults and zeroing on every call: ~20 ms of a 512-token Qwen3-30B-A3B layer on 2
// cores); above kKept bytes it is freed when the holder goes, so one long prompt does not hold it for good. One buffer
// per Tag: callers that nest (cpu_moe around moe_experts) name their own.
template <typename Tag>
class Scratch {
 public:
  explicit Scratch(int64_t n) {
    if (n > capacity()) {
      buffer().reset(new float[n]);
      capacity() = n;
    }
  }
  ~Scratch() {
    if (capacity() * int64_t(sizeof(float)) > kKept) {
      buffer().reset();
      capacity() = 0;
    }
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* data() const { return buffer().get(); }

 private:
  static constexpr int64_t kKept = int64_t(64) << 20;
  static std::unique_ptr<float[]>& buffer() {
    thread_local std::unique_ptr<float[]> b;
    return b;
  }
  static int64_t& capacity() {
    thread_local int64_t c = 0;
    return c;
  }
};

// out[t] += sum_k weights[t, k] * FFN_{ids[t, k]}(hidden[t]) over the pairs with id >= 0. An expert with at least
// gemm_tokens tokens takes the GEMM route with gemm_kernel: 0 torch's on fp32 panels, 1 torch's in bf16 (for bf16 /
// int8 / int4 weights), 2 AMX tiles (on bf16 rows in place, on int8 / int4 rows dequantised
// into bf16 panels; amx_gemm.h). Returns how many experts were active.
int64_t moe_experts(const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                    const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down,
                    const c10::optional<at::Tensor>& down_scale, int64_t isa_level, int64_t gemm_tokens,
                    int64_t gemm_kernel, at::Tensor& out);

// out[t, :] = weight . x[t] for a dense [N, K] weight (bf16 / fp16 / fp32, or int8 / int4 with fp32 group
// scales [N, K / group]), accumulated in fp32.
void dense_matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                  int64_t isa_level, at::Tensor& out);

// x [..., K] times an int8 / int4 weight [N, K] (int4: [N, K / 2]) with its fp16 scales [N, K / group], plus bias,
// in x's dtype: the activations rounded per 32 columns as the micro-kernels round them, the weight dequantised a panel
// of rows at a time into fp32, torch's fp32 GEMM, one rounding. The many-row route of a quantised dense linear.
at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias);

// Sibling linears reading one input x [..., K] (attention's q / k / v): their outputs side by side, [..., sum N_i] in
// x's dtype (weight i's at columns [o_i, o_i + N_i), o_i = N_0 + ... + N_{i-1}), summed in fp32 at the CPU's best ISA
// level, plus biases[i], rounded once; the `hybrid_moe::matvecs` op's CPU kernel. One tensor, not a list: Inductor's
// C++ wrapper calls single-output ops through the dispatcher alone.
at::Tensor matvecs(const at::Tensor& x, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& scales,
                   const c10::List<c10::optional<at::Tensor>>& biases);

// Attention of one query per head (decode) over a key / value cache, the `hybrid_moe::decode_attention` op's CPU
// kernel: query [B, Hq, 1, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv] (one dtype: fp32, bf16 or fp16), mask None,
// boolean (true: may see) or additive, broadcastable as [B, Hq, 1, S]. Scores and softmax in fp32, the output
// [B, 1, Hq, Dv] rounded once to the query's dtype. Positions a key / value head's queries may not see are not read.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& mask, double scale);
// Attention of many queries per head (prefill), the `hybrid_moe::prefill_attention` op's CPU kernel: query [B, Hq, L,
// D], key [B, Hkv, S, D], value [B, Hkv, S, Dv]; mask None (every position, or with `causal` position s for query l
// when s <= l), boolean (true: may see) or additive, broadcastable as [B, Hq, L, S]; out [B, L, Hq, Dv]. bf16 with
// D and Dv multiples of 32 on CPUs with AVX512-BF16 (prefill_attention_available): scores and softmax in fp32, the
// probabilities rounded to bf16 for the product with the values, the output rounded once; otherwise torch's SDPA.
at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const c10::optional<at::Tensor>& mask, double scale, bool causal);
bool prefill_attention_available();
// MLA's decode attention with its up-projection absorbed, the `hybrid_moe::latent_attention` op's CPU kernel: one
// query per head [B, H, 1, nope + rot] over the cached latent [B, 1, S, r] and rotary keys [B, 1, S, rot]. Each
// head's nope part goes through its key rows up_k [H, r, nope] (r wide, rounded to the query's dtype), attends
// (scores: latent and rotary parts summed, softmax in fp32) over the latent as values, and its output through its
// value rows up_v [H, v, r]: out [B, 1, H, v] in the query's dtype. up_k / up_v are fp32, bf16, fp16 or int8 / int4
// with fp16 scales [H, N, K / group] (their activations then quantised as a quantised linear's are); each head's
// rows contiguous, heads any stride apart. Or int8 key rows laid out for the AVX-512 lanes (lay_out_lanes): up_k uint8
// [H, r / 16, nope / 4, 64], its scales [H, r / 16, nope / group, 16], at ISA level 2 only. The mask as
// decode_attention's.
at::Tensor latent_attention(const at::Tensor& query, const at::Tensor& latent, const at::Tensor& k_rot,
                            const at::Tensor& up_k, const c10::optional<at::Tensor>& up_k_scale, const at::Tensor& up_v,
                            const c10::optional<at::Tensor>& up_v_scale, const c10::optional<at::Tensor>& mask,
                            double scale);
// The same at a given ISA level (for tests).
at::Tensor latent_attention_at(const at::Tensor& query, const at::Tensor& latent, const at::Tensor& k_rot,
                               const at::Tensor& up_k, const c10::optional<at::Tensor>& up_k_scale,
                               const at::Tensor& up_v, const c10::optional<at::Tensor>& up_v_scale,
                               const c10::optional<at::Tensor>& mask, double scale, int64_t isa_level);
at::Tensor decode_attention_at(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               const c10::optional<at::Tensor>& mask, double scale, int64_t isa_level);
// int8 rows [H, N, K] with fp16 scales [H, N, K / group] laid out for the AVX-512 lanes, 16 rows a panel: (panels
// uint8 [H, N / 16, K / 4, 64], scales [H, N / 16, K / group, 16]), the key rows latent_attention reads fastest at one
// token, the scales widened to fp32. N a multiple of 16, K of 64; ISA level 2 only.
std::tuple<at::Tensor, at::Tensor> lay_out_lanes(const at::Tensor& rows, const at::Tensor& scales);

// Layers whose experts all run on the CPU, by handle (cpu_layers.cpp): Python publishes a layer (its `owner` number)
// under each handle that names it, forgets a handle that comes to name a layer with slots, drops a layer when it
// dies, and takes its step, token and active-expert counts. `cpu_moe` is the `hybrid_moe::cpu_moe` op's CPU kernel:
// one such layer's decode step on the micro-kernels, in hidden's dtype (`hybrid_moe::dispatch` for a handle that
// names no published layer).
void publish_cpu_layer(int64_t handle, int64_t owner, at::Tensor gate_up, c10::optional<at::Tensor> gate_up_scale,
                       at::Tensor down, c10::optional<at::Tensor> down_scale);
void forget_cpu_handle(int64_t handle);
void drop_cpu_layer(int64_t owner);
std::tuple<int64_t, int64_t, int64_t> take_cpu_layer_counts(int64_t owner);
at::Tensor cpu_moe(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights, int64_t layer);

// Each row's argmax over logits [rows, V] as torch.argmax gives it (fp32, bf16 and fp16 in chunks per thread; other
// dtypes through ATen): greedy decoding's next tokens,
// the `hybrid_moe::greedy_tokens` op's CPU kernel (greedy.cpp).
at::Tensor greedy_tokens(const at::Tensor& logits);

// The highest ISA level this CPU runs: 0 generic, 1 AVX2 + FMA, 2 AVX-512 with VNNI.
int64_t best_isa();

// From how many tokens a call the micro-kernels at ISA `level` sum `format`'s rows ("bf16", "int8", "int4") as lanes:
// measured per machine by ops/cpu_kernel.py, which sets it.
int64_t get_lane_start(int64_t level, const std::string& format);
void set_lane_start(int64_t level, const std::string& format, int64_t tokens);

// Whether the AMX GEMM kernel (gemm_kernel 2) runs here: the CPU has AMX-BF16 and Linux granted the tile state.
bool amx_available();

// Adds the host-function bridge (host_bridge.cpp) to the module.
void bind_host_bridge(pybind11::module_& m);
