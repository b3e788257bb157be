// CPU kernels for one MoE layer's routed experts: the SiLU-gated FFN over (token, expert) pairs.
//
// Why a kernel of our own: at decode an expert is a matrix-vector product whose time is its bytes over
// DRAM bandwidth, and a per-expert torch loop reaches about half of that. Here every active expert's weight
// rows are streamed once by all threads together, for all of that expert's tokens at a time, in the
// stored format (bf16 / fp16 / fp32, or int8 / int4 with one fp16 scale per `group` columns, multiplied in
// integers by activations rounded to int8 per 32 columns: see QuantRecord).
//
// Three phases:
//   A  gu[p, :] = gate_up[e] . x[token(p)]            every active expert, for its pairs p
//      h[p, :]  = silu(gu[p, :I]) * gu[p, I:]          (silu_rows; torch's bf16 route: ATen)
//   B  y[p, :]  = down[e] . h[p]
//   C  out[t, :] += sum_k weight[t, k] * y[pair(t, k)]   (k in order)
// An expert takes one of two routes. Few tokens (decode, bandwidth-bound): the micro-kernels of rows_kernel.h
// stream rows once and dot them with up to a few tokens at a time, work items handed to torch's threads
// dynamically. Many tokens (prefill, compute-bound; from `gemm_tokens` on, measured per machine and shape by the
// caller): torch's GEMM (oneDNN / MKL) on blocks of rows converted to fp32 panels, or (`Gemm::BF16`) in bf16 as
// transformers computes a bf16 model: on the expert's weights as stored (bf16 weights and activations), or on
// panels of int8 / int4 rows dequantised to bf16. On CPUs with native bf16 arithmetic (AVX512-BF16, AMX) bf16 GEMM
// runs several times the fp32 rate. On AMX CPUs (`Gemm::AMX`, amx_gemm.h) our own tiles multiply 32 bf16 rows at a time
// (int8 / int4: dequantised into a panel) by the expert's tokens, these work items shared with the micro-kernels' in
// one pass of the threads.
// On the micro-kernel route every dot product is one thread's full-row sum in a fixed order, so results do
// not depend on the thread count. They may depend, in the last bits, on how many tokens an expert gets: from a few
// tokens a call on (lane_start), int8 / int4 rows are summed as lanes, in another order than the per-row loop, and
// so are bf16 rows times a bf16 model's activations on CPUs with AVX512-BF16. A bf16 model's bf16 experts round h to
// bf16 on every route, as the model does; where h lies near a rounding boundary, such a last-bit difference moves it a
// whole bf16 step, as int8 / int4 activations move by an int8 step.
//
// The decode attention kernel (attention_kernel.h) shares the ISA levels and the threads' work items; its op's entry
// is here too.

#include "moe_cpu.h"

#include <ATen/Parallel.h>

#include "amx_gemm.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define HMOE_X86 1
#endif

namespace {

enum class Fmt { F32, BF16, F16, I8, I4 };
constexpr int64_t bits_of(Fmt f) { return f == Fmt::F32 ? 32 : f == Fmt::I8 ? 8 : f == Fmt::I4 ? 4 : 16; }
// ISA levels of the micro-kernels; the caller passes one the CPU supports (best_isa()).
enum Isa : int64_t { GENERIC = 0, AVX2 = 1, AVX512 = 2 };

// Tokens of an expert a phase-A work item takes at a time (its gate / up buffers). Each chunk lays the rows out for
// the lanes again, and a short last chunk takes the per-row loop: at 32, a 512-token DeepSeek-V2-Lite int8 / int4
// prefill (48 tokens an expert) took 76-78 ms a layer against 69-70 at 128 (benchmarks/RESULTS.md, 2026-11-28).
constexpr int64_t kMaxTokens = 128;
constexpr int64_t kPanelRows = 256;  // rows per weight panel on the GEMM route

// The GEMM route's kernels (the caller's measured choice): torch's on fp32 panels or in bf16, or AMX tiles.
enum class Gemm : int64_t { F32 = 0, BF16 = 1, AMX = 2 };

// fp16 bits as fp32: fp16 weights and activations, and the group scales of int8 / int4 weights, which are fp16 as
// GGUF's Q8_0 / Q4_0 blocks hold them (fp32 scales were a fifth of an int4 weight's bytes at groups of 32, fp16 ones
// are a ninth, and decode reads every byte).
inline float half_to_float(uint16_t v) { return c10::detail::fp16_ieee_to_fp32_value(v); }

// One expert's [N, K] weight in its stored format.
struct Matrix {
  const uint8_t* data;
  const uint16_t* scale;  // fp16 [N, K / group] for int8 / int4, else null
  int64_t row_bytes;
  int64_t K;
  int64_t group;
  Fmt fmt;
  // int4 rows laid out for the lanes, 16 a panel (rows_kernel.h's laid_i4_rows; ops/dense_linear.py `lay_out`): data
  // is [N / 16, K / 8, 64], scale [N / 16, K / group, 16]. row() and row_scale() are then not rows: gather_row() and
  // gather_scales() copy one out.
  bool laid = false;
  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
  const uint16_t* row_scale(int64_t r) const { return scale ? scale + r * (K / group) : nullptr; }
  float scale_at(int64_t r, int64_t g) const { return half_to_float(row_scale(r)[g]); }
  // Row r of a laid-out matrix as stored row by row (row_bytes bytes) into dst; dst.
  const uint8_t* gather_row(int64_t r, uint8_t* dst) const {
    const uint8_t* panel = data + r / 16 * 16 * row_bytes + 4 * (r % 16);
    for (int64_t k = 0; k < row_bytes / 4; ++k) std::memcpy(dst + 4 * k, panel + 64 * k, 4);
    return dst;
  }
  // Row r's scales of a laid-out matrix (K / group) into dst; dst.
  const uint16_t* gather_scales(int64_t r, uint16_t* dst) const {
    const int64_t groups = K / group;
    const uint16_t* panel = scale + r / 16 * 16 * groups + r % 16;
    for (int64_t g = 0; g < groups; ++g) dst[g] = panel[16 * g];
    return dst;
  }
};

// An attention mask as one work item sees it, from its batch row and first query head: boolean (true: may see) or
// additive (added to the scaled scores; -inf: may not see), element strides between heads, query rows and positions
// (0 where it broadcasts); or none (every position).
struct MaskRef {
  const bool* flags = nullptr;
  const float* add = nullptr;
  int64_t head = 0, row = 0, pos = 0;
  bool any() const { return flags || add; }
  float bias(int64_t h, int64_t l, int64_t s) const {
    if (flags) return flags[h * head + l * row + s * pos] ? 0.f : -INFINITY;
    return add ? add[h * head + l * row + s * pos] : 0.f;
  }
};

// m (expanded to [B, Hq, L, S], fp32 if additive; undefined: no mask) from batch row b and query head h0.
MaskRef mask_ref(const at::Tensor& m, int64_t b, int64_t h0) {
  MaskRef r;
  if (!m.defined()) return r;
  const int64_t first = b * m.stride(0) + h0 * m.stride(1);
  if (m.scalar_type() == at::kBool)
    r.flags = m.data_ptr<bool>() + first;
  else
    r.add = m.data_ptr<float>() + first;
  r.head = m.stride(1);
  r.row = m.stride(2);
  r.pos = m.stride(3);
  return r;
}

// One work item of decode attention (attention_kernel.h): the G query heads sharing one key / value head, one query
// each, over S cached positions. Strides are in bytes. A key may come in two parts, its own tensors (MLA's latent and
// rotary key): each query row then holds D + D2 columns, and a score is the sum of both parts' dot products.
struct Attend {
  Fmt fmt;  // of q, k, v and out: fp32, bf16 or fp16
  const uint8_t* q;
  int64_t q_stride;  // between query heads
  const uint8_t* k;
  int64_t k_stride;  // between positions
  const uint8_t* v;
  int64_t v_stride;
  uint8_t* out;
  int64_t out_stride;  // between query heads
  int64_t G, D, Dv, S;
  float scale;
  MaskRef mask;
  const uint8_t* k2 = nullptr;  // the keys' second part (D2 columns), or none
  int64_t k2_stride = 0, D2 = 0;
  float bias(int64_t h, int64_t s) const { return mask.bias(h, 0, s); }
};

// A layer's weight: every expert's Matrix is a fixed stride apart.
struct Layer {
  Matrix first;
  int64_t expert_bytes;
  int64_t expert_scales;
  int64_t N;
  Matrix expert(int64_t e) const {
    Matrix m = first;
    m.data += e * expert_bytes;
    if (m.scale) m.scale += e * expert_scales;
    return m;
  }
};

Fmt format_of(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat:
      return Fmt::F32;
    case at::kBFloat16:
      return Fmt::BF16;
    case at::kHalf:
      return Fmt::F16;
    case at::kChar:
      return Fmt::I8;
    case at::kByte:
      return Fmt::I4;
    default:
      TORCH_CHECK(false, "unsupported expert weight dtype ", w.scalar_type());
  }
}

// A quantised weight's group size is K over its scales' last dimension.
// `experts`: w is [E, N, K] (scales [E, N, K / group]); else one dense [N, K] weight (scales [N, K / group]), read in
// place: no [1, N, K] view is made for it. Each expert's rows must be contiguous; experts may be any stride apart
// (`strided_experts`: per-head rows viewed out of a larger weight, as MLA's absorbed up-projection is).
// Experts' int4 rows may come laid out for the lanes (Matrix::laid; `experts` only): w [E, N / 16, K / 8, 64], scales
// [E, N / 16, K / group, 16], each expert contiguous.
Layer make_layer(const char* name, const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t K,
                 bool experts = true, bool strided_experts = false) {
  const int64_t e = experts ? 1 : 0;
  const bool laid = experts && w.dim() == 4;
  const auto rows_contiguous = [&](const at::Tensor& t) {
    return strided_experts ? t.stride(e + 1) == 1 && t.stride(e) == t.size(e + 1) : t.is_contiguous();
  };
  TORCH_CHECK((w.dim() == e + 2 || laid) && rows_contiguous(w) && w.device().is_cpu(), name,
              " must be a contiguous CPU ", experts ? "[E, N, K] (int4 laid out: [E, N / 16, K / 8, 64])" : "[N, K]",
              " tensor");
  const Fmt fmt = format_of(w);
  const bool quantised = fmt == Fmt::I8 || fmt == Fmt::I4;
  const int64_t stored_k = fmt == Fmt::I4 ? K / 2 : K;
  TORCH_CHECK(!laid || (fmt == Fmt::I4 && w.size(3) == 64 && K % 64 == 0), name,
              ": laid-out experts must be int4 (uint8) [E, N / 16, K / 8, 64] with K a multiple of 64");
  const int64_t columns = laid ? w.size(2) * 4 : w.size(e + 1);
  TORCH_CHECK(columns == stored_k, name, " has ", columns, " columns, expected ", stored_k);
  Layer layer{};
  layer.N = w.size(e) * (laid ? 16 : 1);
  layer.expert_bytes = e ? w.stride(0) * w.element_size() : 0;
  layer.first = Matrix{static_cast<const uint8_t*>(w.data_ptr()), nullptr, stored_k * w.element_size(), K, K, fmt};
  layer.first.laid = laid;
  if (quantised) {
    TORCH_CHECK(scale.has_value(), name, ": int8/int4 weights need scales");
    const at::Tensor& s = *scale;
    const int64_t groups = laid ? s.size(-2) : s.size(-1);
    TORCH_CHECK(s.scalar_type() == at::kHalf && s.dim() == w.dim() && rows_contiguous(s) && s.device().is_cpu() &&
                    (e == 0 || s.size(0) == w.size(0)) && s.size(e) == w.size(e) && (!laid || s.size(3) == 16) &&
                    groups > 0,
                name, " scales must be contiguous CPU fp16 ",
                laid      ? "[E, N / 16, K / group, 16]"
                : experts ? "[E, N, K / group]"
                          : "[N, K / group]");
    const int64_t group = K / groups;
    TORCH_CHECK(K % groups == 0 && group > 0 && group % 32 == 0, name, ": group size ", K, " / ", groups,
                " must be a positive multiple of 32");
    layer.first.scale = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
    layer.first.group = group;
    layer.expert_scales = e ? s.stride(0) : 0;
  } else {
    TORCH_CHECK(!scale.has_value(), name, ": scales given for unquantised weights");
  }
  return layer;
}

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Weight (row, column k) as fp32, `s` the scale of k's group (quantised formats). int4 packs columns 2j and
// 2j + 1 into byte j (low, high nibble), each stored as q + 8 with q in [-8, 7].
template <Fmt F>
inline float weight_at_fmt(const uint8_t* row, int64_t k, float s) {
  if constexpr (F == Fmt::F32) return reinterpret_cast<const float*>(row)[k];
  if constexpr (F == Fmt::BF16) return bf16_to_float(reinterpret_cast<const uint16_t*>(row)[k]);
  if constexpr (F == Fmt::F16) return half_to_float(reinterpret_cast<const uint16_t*>(row)[k]);
  if constexpr (F == Fmt::I8) return float(reinterpret_cast<const int8_t*>(row)[k]) * s;
  if constexpr (F == Fmt::I4) return float(((k % 2) ? row[k / 2] >> 4 : row[k / 2] & 15) - 8) * s;
}

inline float weight_at(const Matrix& m, const uint8_t* row, const uint16_t* scales, int64_t k) {
  const float s = scales ? half_to_float(scales[k / m.group]) : 1.f;
  switch (m.fmt) {
    case Fmt::F32:
      return weight_at_fmt<Fmt::F32>(row, k, s);
    case Fmt::BF16:
      return weight_at_fmt<Fmt::BF16>(row, k, s);
    case Fmt::F16:
      return weight_at_fmt<Fmt::F16>(row, k, s);
    case Fmt::I8:
      return weight_at_fmt<Fmt::I8>(row, k, s);
    case Fmt::I4:
      return weight_at_fmt<Fmt::I4>(row, k, s);
  }
  return 0.f;
}

// bf16 and int4 hold two columns per 32 or 8 bits: their kernels take activations with each kStep-column
// block split into its even then its odd columns (tail columns stay in place).
inline bool pairs_layout(Fmt f) { return f == Fmt::BF16 || f == Fmt::I4; }

constexpr int kRows = 4;  // weight rows per micro-kernel call

// Activations of int8 / int4 weights, quantised to int8 per block of 32 columns (one fp32 scale per block,
// rounded to nearest, as llama.cpp's q8_0): integer products need integer activations, and at decode they
// are what lets an int8 / int4 weight be read at memory speed (widening every weight to fp32 is compute-bound
// on AVX2). One record per activation row: K int8 values, K / 32 scales, K / 32 scale * sum(values) (int4's
// q + 8 offset). int8 keeps the column order; int4 takes the order 32 packed bytes unpack to: for each pair of
// blocks, the even columns of both blocks, then their odd columns (a last unpaired block: even, then odd).
inline int64_t record_bytes(int64_t K) { return K + 2 * (K / 32) * int64_t(sizeof(float)); }

struct QuantRecord {
  const int8_t* q = nullptr;
  const float* scale = nullptr;
  const float* sum = nullptr;
  QuantRecord() = default;
  QuantRecord(const void* rec, int64_t K)
      : q(static_cast<const int8_t*>(rec)),
        scale(reinterpret_cast<const float*>(static_cast<const uint8_t*>(rec) + K)),
        sum(scale + K / 32) {}
};

// Where column c of a K-column row sits in format f's record.
inline int64_t record_pos(int64_t c, int64_t K, Fmt f) {
  if (f != Fmt::I4) return c;
  const int64_t j = c % 32, pair = c / 64;
  if (64 * pair + 64 > K) return c - j + (j % 2) * 16 + j / 2;
  return 64 * pair + (j % 2) * 32 + (c / 32 % 2) * 16 + j / 2;
}

// The exact integer dot product of block b (32 columns) of an int8 / int4 row (int4: q, not q + 8) with record x:
// the portable level's whole row, and the AVX-512 level's blocks after its last full step.
template <Fmt F>
inline int32_t block_dot(const uint8_t* row, int64_t b, const QuantRecord& x, int64_t K) {
  int32_t dot = 0;
  for (int64_t c = 32 * b; c < 32 * b + 32; ++c) {
    const int32_t q =
        F == Fmt::I8 ? reinterpret_cast<const int8_t*>(row)[c] : int32_t(c % 2 ? row[c / 2] >> 4 : row[c / 2] & 15) - 8;
    dot += q * x.q[record_pos(c, K, F)];
  }
  return dot;
}

// 1 / s for a block's scale s, or 0 where that is not finite (an all-zero block, or a largest |x| below 127 / FLT_MAX):
// the block quantises to zeros, on every level alike (ops/quantize.py's quantize_activations too).
inline float inverse_scale(float s) {
  const float inv = 1.f / s;
  return std::isfinite(inv) ? inv : 0.f;
}

// Row x (K fp32 values, natural column order, K % 32 == 0) as format f's record at rec.
void quantise_row(const float* x, int64_t K, Fmt f, uint8_t* rec) {
  int8_t* q = reinterpret_cast<int8_t*>(rec);
  float* scale = reinterpret_cast<float*>(rec + K);
  float* sum = scale + K / 32;
  for (int64_t b = 0; b < K / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int c = 0; c < 32; ++c) amax = std::max(amax, std::fabs(xb[c]));
    const float s = amax / 127.f, inv = inverse_scale(s);
    int32_t total = 0;
    for (int c = 0; c < 32; ++c) {
      const int32_t v = int32_t(std::nearbyint(xb[c] * inv));
      q[record_pos(32 * b + c, K, f)] = int8_t(v);
      total += v;
    }
    scale[b] = s;
    sum[b] = s * float(total);
  }
}

// Where column c of a K-column activation row sits in the layout format f's kernels read (see pairs_layout).
// step (a level's kStep) is a power of two: masks, not divisions by a run-time value, which at one per element cost
// more than a decode call's kernel on a few rows (benchmarks/RESULTS.md, 2026-11-27 afternoon).
inline int64_t layout_pos(int64_t c, int64_t K, Fmt f, int64_t step) {
  if (!pairs_layout(f) || c >= (K & -step)) return c;
  const int64_t j = c & (step - 1);
  return c - j + (j & 1) * (step >> 1) + (j >> 1);
}

// From how many tokens a call each ISA level's micro-kernels sum a format's rows as lanes (rows_kernel.h, lane_route).
// Where the layout starts to pay depends on the CPU: from 8 tokens on the 2-core Zen 5 the AVX-512 lanes were tuned on,
// while on the 16-core H200 Xeon a bf16 expert's 16-token call then took about twice its earlier time (inferred from
// its cost profile; benchmarks/RESULTS.md, 2026-11-28). So ops/cpu_kernel.py measures them per machine (`lane_starts`)
// and sets them (set_lane_start); until then each level's kLaneMinTokens.
int64_t lane_start(int64_t level, Fmt f);

namespace level0 {
#define HMOE_VBYTES 16
#define HMOE_LEVEL 0
#include "rows_kernel.h"
#include "attention_kernel.h"
#undef HMOE_VBYTES
#undef HMOE_LEVEL
}  // namespace level0

#ifdef HMOE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace level1 {
#define HMOE_VBYTES 32
#define HMOE_LEVEL 1
#include "rows_kernel.h"
#include "attention_kernel.h"
#undef HMOE_VBYTES
#undef HMOE_LEVEL
}  // namespace level1
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
namespace level2 {
#define HMOE_VBYTES 64
#define HMOE_LEVEL 2
#include "rows_kernel.h"
#include "attention_kernel.h"
#undef HMOE_VBYTES
#undef HMOE_LEVEL
}  // namespace level2
#pragma GCC pop_options
#endif

constexpr int64_t kNoLanes = std::numeric_limits<int64_t>::max();
#ifdef HMOE_X86
constexpr int64_t kAvx2Lanes = level1::kLaneMinTokens, kAvx512Lanes = level2::kLaneMinTokens;
#else
constexpr int64_t kAvx2Lanes = kNoLanes, kAvx512Lanes = kNoLanes;
#endif
// [level][Fmt]: the formats with a lane route at each level (AVX2: int4; AVX-512: bf16, int8, int4).
std::atomic<int64_t> lane_starts[3][5] = {{kNoLanes, kNoLanes, kNoLanes, kNoLanes, kNoLanes},
                                          {kNoLanes, kNoLanes, kNoLanes, kNoLanes, kAvx2Lanes},
                                          {kNoLanes, kAvx512Lanes, kNoLanes, kAvx512Lanes, kAvx512Lanes}};

int64_t lane_start(int64_t level, Fmt f) { return lane_starts[level][int(f)].load(std::memory_order_relaxed); }

// The format a lane start is named by, where `level` has a lane route for it.
Fmt lane_format(int64_t level, const std::string& name) {
  TORCH_CHECK(level == AVX2 || level == AVX512, "lane routes run at ISA levels 1 and 2, not ", level);
  const Fmt f = name == "bf16" ? Fmt::BF16 : name == "int8" ? Fmt::I8 : name == "int4" ? Fmt::I4 : Fmt::F32;
  TORCH_CHECK(f != Fmt::F32 && (level == AVX512 || f == Fmt::I4), "no lane route for ", name, " at ISA level ", level);
  return f;
}

// The kernels of one ISA level.
struct Kernels {
  int64_t step;  // columns per inner step: the block size of pairs_layout
  void (*matvec_block)(const Matrix&, int64_t, int64_t, const void* const*, int64_t, bool, float*, int64_t);
  void (*dequant_rows)(const Matrix&, int64_t, int64_t, float*);
  void (*dequant_rows_bf16)(const Matrix&, int64_t, int64_t, uint16_t*);
  void (*quantise_rows)(const float*, int64_t, Fmt, uint8_t*, float*);
  void (*silu_rows)(const float*, const float*, int64_t, float*);
  void (*attend)(const Attend&);
};

Kernels kernels_for(Isa isa) {
#ifdef HMOE_X86
  if (isa == AVX512)
    return {level2::kStep,         level2::matvec_block, level2::dequant_rows, level2::dequant_rows_bf16,
            level2::quantise_rows, level2::silu_rows,    level2::attend};
  if (isa == AVX2)
    return {level1::kStep,         level1::matvec_block, level1::dequant_rows, level1::dequant_rows_bf16,
            level1::quantise_rows, level1::silu_rows,    level1::attend};
#endif
  return {level0::kStep,         level0::matvec_block, level0::dequant_rows, level0::dequant_rows_bf16,
          level0::quantise_rows, level0::silu_rows,    level0::attend};
}

// Pairs grouped by expert (in token order within an expert), and each token's pairs in k order.
struct Routing {
  std::vector<int64_t> experts;  // active experts
  std::vector<int64_t> offsets;  // pairs of experts[a]: [offsets[a], offsets[a + 1])
  std::vector<int64_t> pair_token;
  std::vector<int64_t> token_pair;  // [T * K]: pair of (t, k), or -1
};

Routing group_by_expert(const at::Tensor& ids, int64_t num_experts) {
  const int64_t T = ids.size(0), K = ids.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> count(num_experts, 0);
  for (int64_t i = 0; i < T * K; ++i) {
    TORCH_CHECK(id[i] >= -1 && id[i] < num_experts, "expert id ", id[i], " outside [-1, ", num_experts, ")");
    if (id[i] >= 0) ++count[id[i]];
  }
  Routing r;
  std::vector<int64_t> next(num_experts, 0);
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (!count[e]) continue;
    r.experts.push_back(e);
    r.offsets.push_back(total);
    next[e] = total;
    total += count[e];
  }
  r.offsets.push_back(total);
  r.pair_token.resize(total);
  r.token_pair.assign(T * K, -1);
  for (int64_t i = 0; i < T * K; ++i) {
    if (id[i] < 0) continue;
    const int64_t p = next[id[i]]++;
    r.pair_token[p] = i / K;
    r.token_pair[i] = p;
  }
  return r;
}

// The threads parallel_items runs n items on: each gets a worker number below this.
int64_t item_workers(int64_t n) { return std::min<int64_t>(at::get_num_threads(), n); }

// Runs item(i) for i in [0, n) on torch's intra-op threads, handing out items dynamically; or item(i, worker), with
// worker < item_workers(n) numbering the thread that runs it, for scratch the call owns (it is freed with the call,
// where a thread_local buffer would keep its largest size for the process's life).
template <typename Fn>
void parallel_items(int64_t n, const Fn& item) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, item_workers(n), 1, [&](int64_t worker, int64_t) {  // grain 1: one worker a chunk
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
      if constexpr (std::is_invocable_v<const Fn&, int64_t, int64_t>)
        item(i, worker);
      else
        item(i);
    }
  });
}

// layout_pos's order written a step at a time (even columns, then odd ones), without its test per element.
template <typename T, typename ToFloat>
void lay_out_rows(const T* src, int64_t rows, int64_t K, Fmt f, int64_t step, ToFloat to_float, float* dst) {
  const int64_t full = pairs_layout(f) ? (K & -step) : 0, half = step >> 1;
  for (int64_t r = 0; r < rows; ++r) {
    const T* s = src + r * K;
    float* d = dst + r * K;
    for (int64_t c0 = 0; c0 < full; c0 += step)
      for (int64_t j = 0; j < half; ++j) {
        d[c0 + j] = to_float(s[c0 + 2 * j]);
        d[c0 + half + j] = to_float(s[c0 + 2 * j + 1]);
      }
    for (int64_t c = full; c < K; ++c) d[c] = to_float(s[c]);
  }
}

// hidden [T, H] as fp32 in format f's layout: one pass, no ATen op (their fixed cost matters at decode).
void activations(const at::Tensor& hidden, Fmt f, int64_t step, float* dst) {
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const at::Tensor x = hidden.contiguous();
  switch (x.scalar_type()) {
    case at::kFloat:
      return lay_out_rows(x.data_ptr<float>(), T, H, f, step, [](float v) { return v; }, dst);
    case at::kBFloat16:
      return lay_out_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), T, H, f, step, bf16_to_float, dst);
    case at::kHalf:
      return lay_out_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), T, H, f, step, half_to_float, dst);
    default:
      TORCH_CHECK(false, "hidden must be fp32, bf16 or fp16, got ", x.scalar_type());
  }
}

inline bool quantised(Fmt f) { return f == Fmt::I8 || f == Fmt::I4; }

// The layout activation rows are written in before KernelInputs: format f's, or natural order for int8 / int4.
inline Fmt written_layout(Fmt f) { return quantised(f) ? Fmt::F32 : f; }

// Activation rows made ready for format f's kernels. Float formats: the fp32 rows as given, already in the
// kernels' layout. int8 / int4: the rows arrive in natural column order; each becomes a QuantRecord for the
// micro-kernels and, where the GEMM route will read them (`for_gemm`), is rewritten in place as its quantised
// values in the layout: both routes compute one product.
class KernelInputs {
 public:
  KernelInputs(float* rows, int64_t n, int64_t K, Fmt f, const Kernels& kern, bool for_gemm) : rows_(rows), K_(K) {
    if (!quantised(f)) return;
    bytes_ = record_bytes(K);
    records_.resize(n * bytes_);
    at::parallel_for(0, n, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        kern.quantise_rows(rows + r * K, K, f, records_.data() + r * bytes_, for_gemm ? rows + r * K : nullptr);
    });
  }
  const void* row(int64_t r) const {
    return bytes_ ? static_cast<const void*>(records_.data() + r * bytes_) : static_cast<const void*>(rows_ + r * K_);
  }

 private:
  const float* rows_;
  int64_t K_;
  int64_t bytes_ = 0;
  std::vector<uint8_t> records_;
};

// v[0, n) rounded to bf16 values as torch rounds them (nearest even, NaN stays NaN), kept as fp32.
void round_to_bf16(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = uint32_t(c10::detail::round_to_nearest_even(v[i])) << 16;
    std::memcpy(v + i, &b, 4);
  }
}

// Columns [c0, c0 + n) of one pair's h row, silu(g) * u, at h_pos (null: in natural order); with `bf16`, rounded to
// bf16 values, as a bf16 model's experts round it (and the bf16 lanes then take it exactly).
void gate_into(const Kernels& kern, const float* g, const float* u, int64_t n, float* h_row, int64_t c0,
               const int64_t* h_pos, bool bf16) {
  if (!h_pos) {
    kern.silu_rows(g, u, n, h_row + c0);
    if (bf16) round_to_bf16(h_row + c0, n);
    return;
  }
  thread_local std::vector<float> gated;
  gated.resize(n);
  kern.silu_rows(g, u, n, gated.data());
  if (bf16) round_to_bf16(gated.data(), n);
  for (int64_t c = 0; c < n; ++c) h_row[h_pos[c0 + c]] = gated[c];
}

// Rows [r0, r1) of expert matrix m times the n activation rows xs (fp32, m's layout), by panels of rows converted
// to fp32, or (`bf16`) to bf16 a row at a time (through an fp32 row in L1: no fp32 panel goes through the caches),
// and torch's GEMM: the compute-bound route. Returns fp32 [n, r1 - r0].
at::Tensor gemm_rows(const Kernels& kern, const Matrix& m, int64_t r0, int64_t r1, const at::Tensor& xs, bool bf16) {
  at::Tensor out = at::empty({xs.size(0), r1 - r0}, xs.options());
  at::Tensor panel =
      at::empty({std::min(kPanelRows, r1 - r0), m.K}, xs.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const at::Tensor x = bf16 ? xs.to(at::kBFloat16) : xs;
  for (int64_t b0 = r0; b0 < r1; b0 += kPanelRows) {
    const int64_t b1 = std::min(r1, b0 + kPanelRows);
    at::parallel_for(b0, b1, 16, [&](int64_t b, int64_t e) {
      if (bf16)
        kern.dequant_rows_bf16(m, b, e, reinterpret_cast<uint16_t*>(panel.data_ptr<c10::BFloat16>()) + (b - b0) * m.K);
      else
        kern.dequant_rows(m, b, e, panel.data_ptr<float>() + (b - b0) * m.K);
    });
    at::Tensor dst = out.narrow(1, b0 - r0, b1 - b0);
    const at::Tensor rows = panel.narrow(0, 0, b1 - b0);
    if (bf16)
      dst.copy_(at::mm(x, rows.t()));
    else
      at::mm_out(dst, x, rows.t());
  }
  return out;
}

// Rows of expert a's pairs gathered from a [rows, K] fp32 buffer, for the GEMM route.
at::Tensor gather_rows(const float* x, int64_t K, const int64_t* rows, int64_t n) {
  at::Tensor out = at::empty({n, K}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::memcpy(o + i * K, x + rows[i] * K, K * sizeof(float));
  });
  return out;
}

// One bf16 expert on tokens xs [n, H] (bf16) by torch's bf16 GEMM on its weights as stored: gate and up rounded to
// bf16 as the GEMM gives them, h = silu(gate) * up in fp32 rounded once to bf16, y [n, H] in bf16.
at::Tensor bf16_expert(const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& xs) {
  const at::Tensor g_u = at::linear(xs, gate_up).to(at::kFloat);
  const int64_t I = down.size(1);
  return at::linear((at::silu(g_u.narrow(1, 0, I)) * g_u.narrow(1, I, I)).to(at::kBFloat16), down);
}

// Rows per work item on the micro-kernel route, for `rows` rows cut into about `runs` runs. An item's rows are one
// run, read front to back: small items cost bandwidth (each new run restarts the hardware prefetchers, and 64-row
// items left a third of the read bandwidth unused on an AVX-512 EPYC: benchmarks/RESULTS.md, 2026-11-25), while a
// few items per thread let the others make up for a thread slowed by other work. (At decode matvec_runs cuts only a
// call's last few runs shorter.)
int64_t run_rows(int64_t rows, int64_t runs, int64_t unit = kRows) {
  return ((rows + runs - 1) / runs + unit - 1) / unit * unit;
}
constexpr int64_t kRunsPerThread = 4;
constexpr int64_t kGuidedTokens = 4;        // up to this many tokens matvec_runs' runs shrink towards the end
constexpr int64_t kShortestRun = 32 << 10;  // about the bytes of weight rows its shortest runs read

// Each large expert's activation rows (rows_of(p) for its pairs p, in format f's layout), packed for amx_rows in
// natural column order; one expert per thread.
template <typename RowOf>
std::vector<std::vector<uint32_t>> amx_pack_experts(const Routing& r, const std::vector<int64_t>& large, int64_t K,
                                                    Fmt f, int64_t step, const RowOf& row_of) {
  std::vector<int64_t> pos(K);
  for (int64_t c = 0; c < K; ++c) pos[c] = layout_pos(c, K, f, step);
  std::vector<std::vector<uint32_t>> packed(large.size());
  at::parallel_for(0, int64_t(large.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t p0 = r.offsets[large[i]], n = r.offsets[large[i] + 1] - p0;
      std::vector<const float*> rows(n);
      for (int64_t t = 0; t < n; ++t) rows[t] = row_of(p0 + t);
      packed[i].resize(amx_packed_size(n, K));
      amx_pack(rows.data(), pos.data(), n, K, packed[i].data());
    }
  });
  return packed;
}

// Rows [r0, r0 + kAmxRows) of m times a large expert's n packed activation rows, out[t * ld + r]: AMX tiles on bf16
// rows in place, or on int8 / int4 rows dequantised into a bf16 panel in this thread's L2.
void amx_item(const Matrix& m, int64_t r0, const std::vector<uint32_t>& x, int64_t n, float* out, int64_t ld) {
  thread_local std::vector<uint16_t> panel;
  if (m.fmt != Fmt::BF16) {
    panel.resize(amx_panel_size(m.K));
    amx_panel(m.row(r0), m.row_bytes, m.row_scale(r0), m.group, int(bits_of(m.fmt)), m.K, panel.data());
  }
  const AmxWeights w = m.fmt == Fmt::BF16 ? AmxWeights::rows(reinterpret_cast<const uint16_t*>(m.row(r0)), m.row_bytes)
                                          : AmxWeights::panel(panel.data());
  const AmxTiles tiles;
  amx_rows(w, m.K, x.data(), n, out, ld);
}

}  // namespace

// out[t] += sum_k weights[t, k] * FFN_{ids[t, k]}(hidden[t]) over the pairs with id >= 0.
int64_t moe_experts(const at::Tensor& hidden, const at::Tensor& ids, const at::Tensor& weights,
                    const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_scale, const at::Tensor& down,
                    const c10::optional<at::Tensor>& down_scale, int64_t isa_level, int64_t gemm_tokens,
                    int64_t gemm_kernel, at::Tensor& out) {
  TORCH_CHECK(hidden.dim() == 2 && ids.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == hidden.size(0),
              "expected hidden [T, H], ids and weights [T, K]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.is_contiguous(), "ids must be contiguous int64");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous(), "weights must be contiguous fp32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.sizes() == hidden.sizes(),
              "out must be a contiguous fp32 tensor shaped like hidden");
  TORCH_CHECK(isa_level >= GENERIC && isa_level <= AVX512, "unknown ISA level ", isa_level);
  TORCH_CHECK(gemm_tokens > 0, "gemm_tokens must be positive");
  TORCH_CHECK(gemm_kernel >= 0 && gemm_kernel <= 2, "unknown GEMM kernel ", gemm_kernel);
  const Gemm gemm = static_cast<Gemm>(gemm_kernel);
  const int64_t T = hidden.size(0), H = hidden.size(1), K = ids.size(1);
  TORCH_CHECK(H > 0, "hidden has no columns: experts need a hidden size >= 1");
  const Layer gu = make_layer("gate_up", gate_up, gate_up_scale, H);
  TORCH_CHECK(gu.N % 2 == 0 && gu.N > 0, "gate_up must have 2 * I rows, I >= 1");
  const int64_t I = gu.N / 2;
  const Layer dn = make_layer("down", down, down_scale, I);
  TORCH_CHECK(dn.N == H && down.size(0) == gate_up.size(0), "down must be [E, H, I] for the same experts as gate_up");
  TORCH_CHECK(gu.first.fmt == dn.first.fmt, "gate_up and down must share one format");
  const Fmt fmt = gu.first.fmt;
  const bool laid = gu.first.laid;
  TORCH_CHECK(laid == dn.first.laid, "gate_up and down must both be laid out for the lanes, or neither");
  TORCH_CHECK(!laid || isa_level == AVX512, "laid-out int4 experts need ISA level 2 (AVX-512 VNNI)");
  TORCH_CHECK(!laid || I % 16 == 0, "laid-out experts need an intermediate size that is a multiple of 16");

  const Routing r = group_by_expert(ids, gate_up.size(0));
  const int64_t P = r.offsets.back();
  if (P == 0) return 0;
  const Kernels kern = kernels_for(static_cast<Isa>(isa_level));
  std::vector<int64_t> small, large;
  for (int64_t a = 0; a < int64_t(r.experts.size()); ++a)
    (r.offsets[a + 1] - r.offsets[a] >= gemm_tokens ? large : small).push_back(a);
  // The experts with the most tokens first: the threads take work items in order, so a prompt's few hot experts
  // (hundreds of tokens each) cannot start last and leave one thread working alone at a phase's end (in the one profile
  // taken it measured no different: benchmarks/RESULTS.md, 2026-11-28 afternoon).
  std::stable_sort(small.begin(), small.end(), [&](int64_t a, int64_t b) {
    return r.offsets[a + 1] - r.offsets[a] > r.offsets[b + 1] - r.offsets[b];
  });
  // bf16 GEMM (torch's or AMX tiles), for weights bf16 holds exactly or that are approximate already (int8 / int4;
  // fp32 and fp16 weights keep fp32 panels): torch's on the stored weights where they and the activations are bf16
  // (`direct`), else on panels; AMX tiles on bf16 rows in place or on int8 / int4 panels.
  const bool bf16 = gemm != Gemm::F32 && (fmt == Fmt::BF16 || quantised(fmt));
  const bool amx = gemm == Gemm::AMX && bf16;
  TORCH_CHECK(!amx || (amx_available() && H % kAmxRows == 0 && I % kAmxRows == 0),
              "the AMX GEMM route needs a CPU with AMX and hidden and intermediate sizes that are multiples of ",
              kAmxRows, ": choose another gemm_kernel");
  TORCH_CHECK(!amx || !laid, "the AMX GEMM route reads experts row by row: choose another gemm_kernel");
  // A bf16 model's bf16 experts: the activations are bf16 values, h is rounded to bf16 as the model rounds it, and
  // the micro-kernels may multiply both as bf16 (rows_kernel.h's bf16 lanes).
  const bool x_bf16 = fmt == Fmt::BF16 && hidden.scalar_type() == at::kBFloat16;
  const bool direct = bf16 && !amx && x_bf16;
  const bool panels = !large.empty() && !direct;
  const std::vector<int64_t> none;
  const std::vector<int64_t>& torch_gemm = amx ? none : large;  // the large experts torch's GEMM takes

  const Scratch<struct MoeExpertsScratch> scratch(T * H + P * I + P * H);  // activations, h, y
  float* const x = scratch.data();
  float* const h = x + T * H;
  float* const y = h + P * I;
  activations(hidden, written_layout(fmt), kern.step, x);
  const KernelInputs x_in(x, T, H, fmt, kern, panels);
  std::vector<const void*> x_of_pair(P), h_of_pair(P);
  for (int64_t p = 0; p < P; ++p) x_of_pair[p] = x_in.row(r.pair_token[p]);
  std::vector<int64_t> h_pos(I);  // h is written straight into the layout the down projection reads
  for (int64_t c = 0; c < I; ++c) h_pos[c] = layout_pos(c, I, written_layout(fmt), kern.step);
  const int64_t* const h_at = pairs_layout(written_layout(fmt)) ? h_pos.data() : nullptr;

  // Phase A, micro-kernel route. Item i = row block (i / n) of small expert (i % n): all experts stream at
  // once, so an expert with more tokens does not leave one thread working alone at the end. On the AMX route the
  // large experts' items (kAmxRows gate rows and the matching up rows of one expert) follow in the same pass.
  const int64_t n_small = int64_t(small.size()), n_amx = amx ? int64_t(large.size()) : 0;
  const int64_t runs = (kRunsPerThread * at::get_num_threads() + n_small - 1) / std::max<int64_t>(n_small, 1);
  const int64_t unit = laid ? 16 : kRows;  // laid-out rows are read a panel of 16 at a time
  const int64_t block_a = run_rows(I, runs, unit), block_b = run_rows(H, runs, unit);
  const int64_t small_a = n_small ? (I + block_a - 1) / block_a * n_small : 0;
  std::vector<std::vector<uint32_t>> packed;
  if (n_amx) packed = amx_pack_experts(r, large, H, fmt, kern.step, [&](int64_t p) { return x + r.pair_token[p] * H; });
  if (small_a + n_amx) {
    parallel_items(small_a + n_amx * (I / kAmxRows), [&](int64_t i) {
      if (i >= small_a) {
        const int64_t j = (i - small_a) % n_amx, r0 = (i - small_a) / n_amx * kAmxRows;
        const int64_t p0 = r.offsets[large[j]], n = r.offsets[large[j] + 1] - p0;
        const Matrix m = gu.expert(r.experts[large[j]]);
        thread_local std::vector<float> g_u;
        g_u.resize(2 * n * kAmxRows);
        float* const u = g_u.data() + n * kAmxRows;
        amx_item(m, r0, packed[j], n, g_u.data(), kAmxRows);
        amx_item(m, I + r0, packed[j], n, u, kAmxRows);
        for (int64_t t = 0; t < n; ++t)
          gate_into(kern, g_u.data() + t * kAmxRows, u + t * kAmxRows, kAmxRows, h + (p0 + t) * I, r0, h_at, x_bf16);
        return;
      }
      const int64_t a = small[i % n_small], p0 = r.offsets[a], n = r.offsets[a + 1] - p0;
      const int64_t r0 = (i / n_small) * block_a, r1 = std::min(I, r0 + block_a), nr = r1 - r0;
      const Matrix m = gu.expert(r.experts[a]);
      std::vector<float> g(std::min(n, kMaxTokens) * nr), u(g.size());
      for (int64_t t0 = 0; t0 < n; t0 += kMaxTokens) {
        const int64_t nt = std::min(kMaxTokens, n - t0);
        kern.matvec_block(m, r0, r1, x_of_pair.data() + p0 + t0, nt, x_bf16, g.data(), nr);
        kern.matvec_block(m, I + r0, I + r1, x_of_pair.data() + p0 + t0, nt, x_bf16, u.data(), nr);
        for (int64_t t = 0; t < nt; ++t)
          gate_into(kern, g.data() + t * nr, u.data() + t * nr, nr, h + (p0 + t0 + t) * I, r0, h_at, x_bf16);
      }
    });
  }
  // torch's GEMM. bf16: the whole expert at once, y rows written here; fp32 panels: phase A, h rows written here.
  for (const int64_t a : torch_gemm) {
    const int64_t p0 = r.offsets[a], n = r.offsets[a + 1] - p0;
    if (direct) {
      const at::Tensor rows = at::tensor(at::ArrayRef<int64_t>(r.pair_token.data() + p0, n));
      const at::Tensor y_e = bf16_expert(gate_up[r.experts[a]], down[r.experts[a]], hidden.index_select(0, rows));
      at::from_blob(y + p0 * H, {n, H}, at::TensorOptions().dtype(at::kFloat)).copy_(y_e);
      continue;
    }
    const at::Tensor g_u =
        gemm_rows(kern, gu.expert(r.experts[a]), 0, 2 * I, gather_rows(x, H, r.pair_token.data() + p0, n), bf16);
    const float* gp = g_u.data_ptr<float>();
    at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        gate_into(kern, gp + t * 2 * I, gp + t * 2 * I + I, I, h + (p0 + t) * I, 0, h_at, x_bf16);
    });
  }

  // Phase B: y[p] = down[e] . h[p].
  const KernelInputs h_in(h, P, I, fmt, kern, panels);
  for (int64_t p = 0; p < P; ++p) h_of_pair[p] = h_in.row(p);
  const int64_t small_b = n_small ? (H + block_b - 1) / block_b * n_small : 0;
  if (n_amx) packed = amx_pack_experts(r, large, I, fmt, kern.step, [&](int64_t p) { return h + p * I; });
  if (small_b + n_amx) {
    parallel_items(small_b + n_amx * (H / kAmxRows), [&](int64_t i) {
      if (i >= small_b) {
        const int64_t j = (i - small_b) % n_amx, r0 = (i - small_b) / n_amx * kAmxRows;
        const int64_t p0 = r.offsets[large[j]], n = r.offsets[large[j] + 1] - p0;
        amx_item(dn.expert(r.experts[large[j]]), r0, packed[j], n, y + p0 * H + r0, H);
        return;
      }
      const int64_t a = small[i % n_small], p0 = r.offsets[a], n = r.offsets[a + 1] - p0;
      const int64_t r0 = (i / n_small) * block_b, r1 = std::min(H, r0 + block_b);
      kern.matvec_block(dn.expert(r.experts[a]), r0, r1, h_of_pair.data() + p0, n, x_bf16, y + p0 * H + r0, H);
    });
  }
  for (const int64_t a : torch_gemm) {
    if (direct) continue;
    const int64_t p0 = r.offsets[a], n = r.offsets[a + 1] - p0;
    const at::Tensor ye = gemm_rows(kern, dn.expert(r.experts[a]), 0, H,
                                    at::from_blob(h + p0 * I, {n, I}, at::TensorOptions().dtype(at::kFloat)), bf16);
    std::memcpy(y + p0 * H, ye.data_ptr<float>(), n * H * sizeof(float));
  }

  // Phase C: each token's pairs summed in k order.
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 4096 / H), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t p = r.token_pair[t * K + k];
        if (p < 0) continue;
        const float w = wp[t * K + k];
        const float* src = y + p * H;
        float* dst = op + t * H;
        for (int64_t j = 0; j < H; ++j) dst[j] += w * src[j];
      }
  });
  return int64_t(r.experts.size());
}

namespace {

// x [T, K] times each of `ms` (dense [N_i, K] matrices of one format): every thread streams row runs taken from all
// of them at once, the activations prepared once. finish(i, r0, r1) runs after the run [r0, r1) of matrix i
// is in out_i = outs[i] ([T, N_i] fp32, row stride ld_i), on the thread that computed it.
template <typename Finish>
void matvec_runs(const at::Tensor& x, const std::vector<Matrix>& ms, const std::vector<int64_t>& rows_of,
                 const std::vector<float*>& outs, const std::vector<int64_t>& lds, Isa isa, const Finish& finish) {
  const int64_t T = x.size(0), K = x.size(1);
  if (T == 0 || ms.empty()) return;
  TORCH_CHECK(K > 0, "x has no columns: a dense product needs K >= 1");
  const Fmt fmt = ms[0].fmt;
  const Kernels kern = kernels_for(isa);
  std::vector<float> xs(T * K);
  activations(x, written_layout(fmt), kern.step, xs.data());
  const KernelInputs in(xs.data(), T, K, fmt, kern, false);
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  std::vector<const void*> rows(T);
  for (int64_t t = 0; t < T; ++t) rows[t] = in.row(t);
  int64_t total = 0;
  for (const int64_t n : rows_of) total += n;
  // At decode (up to kGuidedTokens tokens) runs shrink with the rows left (guided), from run_rows' length down to
  // about kShortestRun bytes of rows (whole kRows groups, never longer than run_rows'), so that the threads' last runs
  // end close together: with equal runs one thread waited for the other's last one, 2% of the q / k / v and o
  // projections' rate at decode in a one-off timing (4 layers of Qwen3-30B-A3B's int4 projections after a 64 MB
  // pass, 2 threads, AVX2 EPYC). More tokens keep equal runs: a run's fixed costs (the activations' lanes, a partial
  // lane panel) grow with the token count.
  const int64_t threads = at::get_num_threads(), longest = run_rows(total, kRunsPerThread * threads);
  const int64_t shortest =
      T <= kGuidedTokens ? std::min(longest, std::max<int64_t>(kRows, kShortestRun / ms[0].row_bytes / kRows * kRows))
                         : longest;
  struct Run {
    int64_t i, r0, r1;
  };
  std::vector<Run> runs;
  int64_t left = total;
  for (int64_t i = 0; i < int64_t(ms.size()); ++i)
    for (int64_t r0 = 0; r0 < rows_of[i];) {
      int64_t size = std::clamp(run_rows(left, 2 * threads), shortest, longest);
      if (ms[i].laid) size = (size + 15) / 16 * 16;  // whole panels
      const int64_t r1 = std::min(rows_of[i], r0 + size);
      runs.push_back({i, r0, r1});
      left -= r1 - r0;
      r0 = r1;
    }
  parallel_items(int64_t(runs.size()), [&](int64_t j) {
    const Run& run = runs[j];
    kern.matvec_block(ms[run.i], run.r0, run.r1, rows.data(), T, x_bf16, outs[run.i] + run.r0, lds[run.i]);
    finish(run.i, run.r0, run.r1);
  });
}

// A dense [N, K] weight (int4: [N, K / 2]) with its optional scales [N, K / group] as a Matrix, holding the tensors
// the Matrix points into: contiguous copies where the caller's were strided, which must outlive the product.
struct DenseWeight {
  at::Tensor weight, scale;
  Matrix m;
  int64_t rows = 0;
};

// An int4 weight laid out for the lanes (Matrix::laid): [N / 16, K / 8, 64] uint8 with fp16 scales [N / 16, K / group,
// 16], on a CPU whose kernels read it (AVX-512 VNNI).
DenseWeight laid_weight(const at::Tensor& weight, const c10::optional<at::Tensor>& scale, int64_t K) {
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.size(1) * 8 == K && weight.size(2) == 64 &&
                  weight.device().is_cpu() && K % 64 == 0,
              "a laid-out int4 weight must be a CPU uint8 tensor [N / 16, K / 8, 64], K a multiple of 64");
  TORCH_CHECK(scale.has_value() && scale->dim() == 3 && scale->scalar_type() == at::kHalf &&
                  scale->size(0) == weight.size(0) && scale->size(2) == 16 && scale->size(1) > 0 &&
                  K % scale->size(1) == 0 && (K / scale->size(1)) % 32 == 0 && scale->device().is_cpu(),
              "a laid-out int4 weight needs fp16 scales [N / 16, K / group, 16], the group a multiple of 32");
  TORCH_CHECK(best_isa() == AVX512, "laid-out int4 weights need the AVX-512 VNNI kernels, which this CPU lacks");
  DenseWeight d;
  d.weight = weight.contiguous();
  d.scale = scale->contiguous();
  d.m = Matrix{d.weight.data_ptr<uint8_t>(),
               reinterpret_cast<const uint16_t*>(d.scale.data_ptr<at::Half>()),
               K / 2,
               K,
               K / scale->size(1),
               Fmt::I4,
               true};
  d.rows = 16 * weight.size(0);
  return d;
}

DenseWeight dense_weight(const at::Tensor& weight, const c10::optional<at::Tensor>& scale, int64_t K) {
  if (weight.dim() == 3) return laid_weight(weight, scale, K);
  TORCH_CHECK(weight.dim() == 2, "expected a weight [N, K] (int4: [N, K / 2], laid out: [N / 16, K / 8, 64])");
  TORCH_CHECK(!scale.has_value() || scale->dim() == 2, "expected scales [N, K / group] beside a dense weight");
  DenseWeight d;
  d.weight = weight.contiguous();
  c10::optional<at::Tensor> s;
  if (scale.has_value()) {
    d.scale = scale->contiguous();
    s = d.scale;
  }
  const Layer layer = make_layer("weight", d.weight, s, K, false);
  d.m = layer.first;
  d.rows = layer.N;
  return d;
}

// x [..., K] as the contiguous rows [T, K] `op` multiplies: a CPU fp32 / bf16 / fp16 tensor.
at::Tensor input_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), op, ": x must be a CPU tensor [..., K]");
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x must be fp32, bf16 or fp16");
  return x.dim() == 2 && x.is_contiguous() ? x : x.reshape({-1, x.size(-1)}).contiguous();
}

// x's shape with its last dimension n: an output of x's rows.
std::vector<int64_t> shape_with_last(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(n);
  return shape;
}

template <typename T>
void round_rows(const float* src, int64_t T_, int64_t ld, int64_t r0, int64_t r1, const float* bias, T* dst,
                int64_t dst_ld) {
  for (int64_t t = 0; t < T_; ++t)
    for (int64_t r = r0; r < r1; ++r) dst[t * dst_ld + r] = T(src[t * ld + r] + (bias ? bias[r] : 0.f));
}

}  // namespace

void dense_matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                  int64_t isa_level, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2, "expected x [T, K]");
  TORCH_CHECK(isa_level >= GENERIC && isa_level <= AVX512, "unknown ISA level ", isa_level);
  const DenseWeight w = dense_weight(weight, scale, x.size(1));
  const int64_t N = w.rows;
  TORCH_CHECK(!w.m.laid || isa_level == AVX512, "laid-out int4 weights need ISA level 2 (AVX-512 VNNI)");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == N,
              "out must be a contiguous fp32 [T, N] tensor");
  matvec_runs(x.contiguous(), {w.m}, {N}, {out.data_ptr<float>()}, {N}, static_cast<Isa>(isa_level),
              [](int64_t, int64_t, int64_t) {});
}

at::Tensor dense_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                      const c10::optional<at::Tensor>& bias) {
  const at::Tensor rows = input_rows(x, "dense_gemm");
  TORCH_CHECK(weight.scalar_type() == at::kChar || weight.scalar_type() == at::kByte,
              "dense_gemm: the weight must be int8 or packed int4 (uint8)");
  const int64_t K = rows.size(1);
  const DenseWeight w = dense_weight(weight, scale, K);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == w.rows && bias->device().is_cpu()),
              "dense_gemm: bias must be a CPU tensor [N]");
  static const Kernels kern = kernels_for(static_cast<Isa>(best_isa()));
  at::Tensor xs = at::empty({rows.size(0), K}, at::TensorOptions().dtype(at::kFloat));
  activations(rows, written_layout(w.m.fmt), kern.step, xs.data_ptr<float>());
  // Built for its side effect: it rewrites xs as its rows rounded exactly as the micro-kernels round them (its records
  // go unread), so either route computes one product.
  const KernelInputs rounded(xs.data_ptr<float>(), rows.size(0), K, w.m.fmt, kern, true);
  at::Tensor out = gemm_rows(kern, w.m, 0, w.rows, xs, false);
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return out.to(x.scalar_type()).reshape(shape_with_last(x, w.rows));
}

at::Tensor matvecs(const at::Tensor& x, at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& scales,
                   const c10::List<c10::optional<at::Tensor>>& biases) {
  const int64_t n = int64_t(weights.size());
  TORCH_CHECK(n > 0 && int64_t(scales.size()) == n && int64_t(biases.size()) == n,
              "matvecs: one scale and one bias entry (or None) per weight");
  const at::ScalarType dtype = x.scalar_type();
  const at::Tensor rows = input_rows(x, "matvecs");
  const int64_t K = rows.size(1), T = rows.size(0);
  std::vector<DenseWeight> held(n);
  std::vector<Matrix> ms(n);
  std::vector<int64_t> N(n), lds(n), offsets(n);
  std::vector<float*> outs(n);
  std::vector<at::Tensor> biases_f(n);
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) {
    held[i] = dense_weight(weights[i], scales.get(i), K);
    ms[i] = held[i].m;
    N[i] = held[i].rows;
    TORCH_CHECK(ms[i].fmt == ms[0].fmt, "matvecs: every weight must share one format");
    const c10::optional<at::Tensor> b = biases.get(i);
    if (b.has_value()) {
      TORCH_CHECK(b->dim() == 1 && b->size(0) == N[i] && b->device().is_cpu(), "matvecs: bias ", i,
                  " must be a CPU tensor [N]");
      biases_f[i] = b->to(at::kFloat).contiguous();
    }
    total += N[i];
  }
  std::vector<float> acc(T * total);  // fp32 sums side by side, each weight's columns at its offset
  for (int64_t i = 0, offset = 0; i < n; offset += N[i], ++i) {
    offsets[i] = offset;
    outs[i] = acc.data() + offset;
    lds[i] = total;
  }
  at::Tensor out = at::empty(shape_with_last(x, total), x.options());
  // Each run is rounded to x's dtype (bias added in fp32) by the thread that summed it: one rounding, as torch's
  // GEMM gives it, and no second pass over the outputs.
  static const Isa isa = static_cast<Isa>(best_isa());
  matvec_runs(rows, ms, N, outs, lds, isa, [&](int64_t i, int64_t r0, int64_t r1) {
    const float* bias = biases_f[i].defined() ? biases_f[i].data_ptr<float>() : nullptr;
    switch (dtype) {
      case at::kFloat:
        return round_rows(outs[i], T, total, r0, r1, bias, out.data_ptr<float>() + offsets[i], total);
      case at::kBFloat16:
        return round_rows(outs[i], T, total, r0, r1, bias, out.data_ptr<c10::BFloat16>() + offsets[i], total);
      default:
        return round_rows(outs[i], T, total, r0, r1, bias, out.data_ptr<c10::Half>() + offsets[i], total);
    }
  });
  return out;
}

namespace {

// A decode step's mask as the attention kernels read it: boolean, or additive in fp32, expanded to [B, H, 1, S]
// (undefined for none).
at::Tensor decode_mask(const c10::optional<at::Tensor>& mask, int64_t B, int64_t H, int64_t S, const char* op) {
  if (!mask.has_value()) return {};
  TORCH_CHECK(mask->dim() == 4 && mask->device().is_cpu() && (mask->size(0) == 1 || mask->size(0) == B) &&
                  (mask->size(1) == 1 || mask->size(1) == H) && mask->size(2) == 1 &&
                  (mask->size(3) == 1 || mask->size(3) == S),
              op, ": the mask must be a CPU tensor broadcastable as [B, Hq, 1, S]");
  TORCH_CHECK(mask->scalar_type() == at::kBool || at::isFloatingType(mask->scalar_type()), op,
              ": the mask must be boolean or additive (floating)");
  return (mask->scalar_type() == at::kBool ? *mask : mask->to(at::kFloat)).expand({B, H, 1, S});
}

// Key rows laid out for the lanes (lay_out_lanes), as latent_attention reads them.
struct LaidOut {
  const uint8_t* panels = nullptr;  // [H, N / 16, K / 4, 64]
  const float* scales = nullptr;    // [H, N / 16, K / group, 16]
  int64_t N = 0, K = 0, group = 0;
};

// Rows [i0, i1) of rows [n, K] (x's dtype) times one head's rows each: out[(i - i0) * ld + j] = row j of head i % H
// . rows[i], N rows summed in fp32 (the activations quantised as a quantised weight's kernels take them) and rounded
// to x's dtype. The head's rows are heads.expert(i % H), or with `laid` (int8, ISA level 2) its laid-out panels, four
// at a time. On the calling thread: each work item of latent_attention runs its own heads.
template <typename T>
void head_products(const Kernels& kern, const Layer& heads, const LaidOut* laid, int64_t H, const at::Tensor& rows,
                   int64_t i0, int64_t i1, T* out, int64_t ld) {
  const int64_t n = i1 - i0, K = rows.size(1), N = laid ? laid->N : heads.N;
  const Fmt fmt = laid ? Fmt::I8 : heads.first.fmt;
  std::vector<float> xs(n * K), sums(N);
  activations(rows.narrow(0, i0, n), written_layout(fmt), kern.step, xs.data());
  const KernelInputs in(xs.data(), n, K, fmt, kern, false);
  for (int64_t i = 0; i < n; ++i) {
    const void* x = in.row(i);
    const int64_t h = (i0 + i) % H;
    if (laid) {
#ifdef HMOE_X86
      level2::laid_out_matvec(laid->panels + h * N * K, laid->scales + h * N * (K / laid->group), N / 16, K,
                              laid->group, x, sums.data());
#endif
    } else {
      kern.matvec_block(heads.expert(h), 0, N, &x, 1, false, sums.data(), N);
    }
    round_rows(sums.data(), 1, N, 0, N, nullptr, out + i * ld, N);
  }
}

template <typename T>
T* data_as(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace

at::Tensor decode_attention_at(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               const c10::optional<at::Tensor>& mask, double scale, int64_t isa_level) {
  TORCH_CHECK(isa_level >= GENERIC && isa_level <= best_isa(), "decode_attention: ISA level ", isa_level,
              " not available here");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4 && query.size(2) == 1,
              "decode_attention: expected query [B, Hq, 1, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv]");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "decode_attention: query, key and value must be CPU tensors");
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), Dv = value.size(3);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B && value.size(1) == Hkv && value.size(2) == S &&
                  key.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && S > 0 && D > 0 && Dv > 0,
              "decode_attention: key / value must be [B, Hkv, S, D] / [B, Hkv, S, Dv] with S, D, Dv >= 1 and Hkv "
              "dividing Hq");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "decode_attention: query, key and value must share one dtype");
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "decode_attention: fp32, bf16 or fp16 only, got ", dtype);
  const Fmt fmt = format_of(query);
  const at::Tensor q = query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  const at::Tensor m = decode_mask(mask, B, Hq, S, "decode_attention");
  at::Tensor out = at::empty({B, 1, Hq, Dv}, q.options());
  const int64_t es = q.element_size(), G = Hq / Hkv;
  const auto* qp = static_cast<const uint8_t*>(q.data_ptr());
  const auto* kp = static_cast<const uint8_t*>(k.data_ptr());
  const auto* vp = static_cast<const uint8_t*>(v.data_ptr());
  auto* op = static_cast<uint8_t*>(out.data_ptr());
  const Kernels kern = kernels_for(static_cast<Isa>(isa_level));
  parallel_items(B * Hkv, [&](int64_t i) {
    const int64_t b = i / Hkv, g = i % Hkv;
    Attend a{fmt,
             qp + (b * Hq + g * G) * D * es,
             D * es,
             kp + (b * k.stride(0) + g * k.stride(1)) * es,
             k.stride(2) * es,
             vp + (b * v.stride(0) + g * v.stride(1)) * es,
             v.stride(2) * es,
             op + (b * Hq + g * G) * Dv * es,
             Dv * es,
             G,
             D,
             Dv,
             S,
             float(scale),
             mask_ref(m, b, g * G)};
    kern.attend(a);
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& mask, double scale) {
  static const int64_t isa = best_isa();
  return decode_attention_at(query, key, value, mask, scale, isa);
}

at::Tensor latent_attention_at(const at::Tensor& query, const at::Tensor& latent, const at::Tensor& k_rot,
                               const at::Tensor& up_k, const c10::optional<at::Tensor>& up_k_scale,
                               const at::Tensor& up_v, const c10::optional<at::Tensor>& up_v_scale,
                               const c10::optional<at::Tensor>& mask, double scale, int64_t isa_level) {
  TORCH_CHECK(isa_level >= GENERIC && isa_level <= best_isa(), "latent_attention: ISA level ", isa_level,
              " not available here");
  const bool laid_out = up_k.dim() == 4;  // int8 key rows laid out for the lanes (lay_out_lanes)
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1 && latent.dim() == 4 && k_rot.dim() == 4 &&
                  (up_k.dim() == 3 || laid_out) && up_v.dim() == 3,
              "latent_attention: expected query [B, H, 1, nope + rot], latent [B, 1, S, r], k_rot [B, 1, S, rot], "
              "up_k [H, r, nope] (or laid out: [H, r / 16, nope / 4, 64]), up_v [H, v, r]");
  const int64_t B = query.size(0), H = query.size(1), S = latent.size(2), r = latent.size(3), rot = k_rot.size(3);
  const int64_t nope = query.size(3) - rot;
  TORCH_CHECK(latent.size(0) == B && latent.size(1) == 1 && k_rot.size(0) == B && k_rot.size(1) == 1 &&
                  k_rot.size(2) == S && S > 0 && r > 0 && rot > 0 && nope > 0 && up_k.size(0) == H &&
                  up_v.size(0) == H && up_k.size(1) * (laid_out ? 16 : 1) == r,
              "latent_attention: latent / k_rot must be [B, 1, S, r] / [B, 1, S, rot] with S >= 1, up_k [H, r, nope] "
              "and up_v [H, v, r], nope = the query's width - rot >= 1");
  LaidOut laid{};
  if (laid_out) {
    TORCH_CHECK(isa_level == AVX512, "latent_attention: key rows laid out for the lanes run at ISA level 2 only");
    TORCH_CHECK(up_k.scalar_type() == at::kByte && up_k.is_contiguous() && up_k.size(2) * 4 == nope &&
                    up_k.size(3) == 64 && up_k_scale.has_value() && up_k_scale->scalar_type() == at::kFloat &&
                    up_k_scale->is_contiguous() && up_k_scale->dim() == 4 && up_k_scale->size(0) == H &&
                    up_k_scale->size(1) == up_k.size(1) && up_k_scale->size(2) > 0 && nope % up_k_scale->size(2) == 0 &&
                    nope / up_k_scale->size(2) % 32 == 0 && up_k_scale->size(3) == 16,
                "latent_attention: laid-out key rows must be contiguous uint8 [H, r / 16, nope / 4, 64] with fp32 "
                "scales [H, r / 16, nope / group, 16], group a multiple of 32 (lay_out_lanes makes them)");
    laid = {up_k.data_ptr<uint8_t>(), up_k_scale->data_ptr<float>(), r, nope, nope / up_k_scale->size(2)};
  }
  const at::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(latent.scalar_type() == dtype && k_rot.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "latent_attention: query, latent and k_rot must share one dtype: fp32, bf16 or fp16");
  TORCH_CHECK(query.device().is_cpu() && latent.device().is_cpu() && k_rot.device().is_cpu(),
              "latent_attention: query, latent and k_rot must be CPU tensors");
  const Layer keys = laid_out ? Layer{} : make_layer("up_k", up_k, up_k_scale, nope, true, true);
  const Layer values = make_layer("up_v", up_v, up_v_scale, r, true, true);
  const int64_t v = values.N;
  const at::Tensor m = decode_mask(mask, B, H, S, "latent_attention");
  if (B == 0 || H == 0) return at::empty({B, 1, H, v}, query.options());
  const Kernels kern = kernels_for(static_cast<Isa>(isa_level));
  const at::Tensor q = query.contiguous();
  const at::Tensor c = latent.stride(3) == 1 ? latent : latent.contiguous();
  const at::Tensor kr = k_rot.stride(3) == 1 ? k_rot : k_rot.contiguous();
  // Each batch row's heads in as many groups as threads are left for them; a group's work item runs its heads'
  // products and attention (reading the cache once) with no wait between them.
  const int64_t groups = std::min<int64_t>(H, std::max<int64_t>(1, at::get_num_threads() / B));
  const int64_t per_group = (H + groups - 1) / groups, es = q.element_size();
  // The query as the attention reads it: each head's nope part through its key rows (r wide), then its rotary part.
  at::Tensor q_cat = at::empty({B * H, r + rot}, q.options());
  const at::Tensor nope_rows = q.view({B * H, nope + rot}).narrow(1, 0, nope);
  at::Tensor o_latent = at::empty({B * H, r}, q.options());
  at::Tensor out = at::empty({B, 1, H, v}, q.options());
  const auto* cp = static_cast<const uint8_t*>(c.data_ptr());
  const auto* kp = static_cast<const uint8_t*>(kr.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "latent_attention", [&] {
    parallel_items(B * groups, [&](int64_t i) {
      const int64_t b = i / groups, h0 = i % groups * per_group, G = std::min(per_group, H - h0);
      if (G <= 0) return;
      const int64_t first = b * H + h0;  // the group's first row of B * H
      head_products(kern, keys, laid_out ? &laid : nullptr, H, nope_rows, first, first + G,
                    data_as<scalar_t>(q_cat) + first * (r + rot), r + rot);
      for (int64_t row = first; row < first + G; ++row)  // the rotary part as it is
        std::memcpy(data_as<scalar_t>(q_cat) + row * (r + rot) + r, data_as<scalar_t>(q) + row * (nope + rot) + nope,
                    rot * es);
      const uint8_t* latent_rows = cp + b * c.stride(0) * es;
      Attend a{format_of(q),
               static_cast<const uint8_t*>(q_cat.data_ptr()) + first * (r + rot) * es,
               (r + rot) * es,
               latent_rows,
               c.stride(2) * es,
               latent_rows,
               c.stride(2) * es,
               static_cast<uint8_t*>(o_latent.data_ptr()) + first * r * es,
               r * es,
               G,
               r,
               r,
               S,
               float(scale),
               mask_ref(m, b, h0),
               kp + b * kr.stride(0) * es,
               kr.stride(2) * es,
               rot};
      kern.attend(a);
      head_products(kern, values, nullptr, H, o_latent, first, first + G, data_as<scalar_t>(out) + first * v, v);
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> lay_out_lanes(const at::Tensor& rows, const at::Tensor& scales) {
  TORCH_CHECK(best_isa() == AVX512, "lay_out_lanes: the lanes run at ISA level 2 (AVX-512 with VNNI) only");
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kChar && rows.size(1) > 0 && rows.size(1) % 16 == 0 &&
                  rows.size(2) > 0 && rows.size(2) % 64 == 0,
              "lay_out_lanes: rows must be int8 [H, N, K] with N a multiple of 16 and K of 64");
  const at::Tensor w = rows.contiguous(), s = scales.contiguous();
  const int64_t H = w.size(0), N = w.size(1), K = w.size(2);
  const Layer layer = make_layer("rows", w, s, K);
  at::Tensor panels = at::empty({H, N / 16, K / 4, 64}, w.options().dtype(at::kByte));
  at::Tensor laid_scales = at::empty({H, N / 16, K / layer.first.group, 16}, s.options().dtype(at::kFloat));
#ifdef HMOE_X86
  for (int64_t h = 0; h < H; ++h)
    level2::lay_out_panels(layer.expert(h), N, panels.data_ptr<uint8_t>() + h * N * K,
                           laid_scales.data_ptr<float>() + h * N * (K / layer.first.group));
#endif
  return {panels, laid_scales};
}

at::Tensor latent_attention(const at::Tensor& query, const at::Tensor& latent, const at::Tensor& k_rot,
                            const at::Tensor& up_k, const c10::optional<at::Tensor>& up_k_scale, const at::Tensor& up_v,
                            const c10::optional<at::Tensor>& up_v_scale, const c10::optional<at::Tensor>& mask,
                            double scale) {
  static const int64_t isa = best_isa();
  return latent_attention_at(query, latent, k_rot, up_k, up_k_scale, up_v, up_v_scale, mask, scale, isa);
}

int64_t get_lane_start(int64_t level, const std::string& format) {
  return lane_start(level, lane_format(level, format));
}

void set_lane_start(int64_t level, const std::string& format, int64_t tokens) {
  TORCH_CHECK(tokens >= 1, "a lane start is a token count >= 1, got ", tokens);
  lane_starts[level][int(lane_format(level, format))].store(tokens, std::memory_order_relaxed);
}

bool prefill_attention_available() {
#ifdef HMOE_X86
  return best_isa() == AVX512 && level2::bf16_lanes();
#else
  return false;
#endif
}

// Query rows of one work item (with every query head of its key / value head): a block's scores, probabilities and
// laid-out keys and values stay in L2.
constexpr int64_t kQueryBlock = 16;

at::Tensor prefill_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const c10::optional<at::Tensor>& mask, double scale, bool causal) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "prefill_attention: expected query [B, Hq, L, D], key [B, Hkv, S, D], value [B, Hkv, S, Dv]");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "prefill_attention: query, key and value must be CPU tensors");
  const int64_t B = query.size(0), Hq = query.size(1), L = query.size(2), D = query.size(3);
  const int64_t Hkv = key.size(1), S = key.size(2), Dv = value.size(3);
  TORCH_CHECK(
      key.size(0) == B && value.size(0) == B && value.size(1) == Hkv && value.size(2) == S && key.size(3) == D &&
          Hkv > 0 && Hq % Hkv == 0 && S > 0 && L > 0,
      "prefill_attention: key / value must be [B, Hkv, S, D] / [B, Hkv, S, Dv] with S >= 1 and Hkv dividing Hq");
  const bool bf16 = query.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                    value.scalar_type() == at::kBFloat16;
  if (!prefill_attention_available() || !bf16 || D % 32 != 0 || Dv % 32 != 0)  // SDPA's, as the op's torch form
    return at::scaled_dot_product_attention(query, key, value, mask, 0.0, causal && !mask.has_value(), scale, Hq != Hkv)
        .transpose(1, 2)
        .contiguous();
#ifdef HMOE_X86
  const at::Tensor q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  at::Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 4 && mask->device().is_cpu() && (mask->size(0) == 1 || mask->size(0) == B) &&
                    (mask->size(1) == 1 || mask->size(1) == Hq) && (mask->size(2) == 1 || mask->size(2) == L) &&
                    (mask->size(3) == 1 || mask->size(3) == S),
                "prefill_attention: the mask must be a CPU tensor broadcastable as [B, Hq, L, S]");
    TORCH_CHECK(mask->scalar_type() == at::kBool || at::isFloatingType(mask->scalar_type()),
                "prefill_attention: the mask must be boolean or additive (floating)");
    m = (mask->scalar_type() == at::kBool ? *mask : mask->to(at::kFloat)).expand({B, Hq, L, S});
  }
  at::Tensor out = at::empty({B, L, Hq, Dv}, q.options());
  const int64_t G = Hq / Hkv, blocks = (L + kQueryBlock - 1) / kQueryBlock;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr<c10::BFloat16>());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr<c10::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  std::vector<level2::RowsScratch> scratch(item_workers(B * Hkv * blocks));  // ~40 MB a worker at 32k positions
  parallel_items(B * Hkv * blocks, [&](int64_t i, int64_t worker) {
    // each head's last block first: under a causal mask it sees the most positions, and would otherwise come last
    const int64_t b = i / (Hkv * blocks), g = i / blocks % Hkv, l0 = (blocks - 1 - i % blocks) * kQueryBlock;
    level2::AttendRows a{qp + (b * Hq + g * G) * L * D,
                         L * D,
                         D,
                         kp + (b * Hkv + g) * S * D,
                         vp + (b * Hkv + g) * S * Dv,
                         op + (b * L * Hq + g * G) * Dv,
                         Hq * Dv,
                         Dv,
                         G,
                         L,
                         S,
                         D,
                         Dv,
                         float(scale),
                         mask_ref(m, b, g * G),
                         causal};
    level2::attend_rows(a, l0, std::min(L, l0 + kQueryBlock), scratch[worker]);
  });
  return out;
#else
  return at::Tensor();  // not reached: prefill_attention_available() is false
#endif
}

// The highest ISA level this CPU runs: 0 generic, 1 AVX2 + FMA, 2 AVX-512 with VNNI.
int64_t best_isa() {
#ifdef HMOE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AVX2;
#endif
  return GENERIC;
}
