// `hybrid_moe::greedy_tokens`: each row's argmax, the next token of greedy decoding (generation.py). ATen's argmax is a
// scalar loop with an index beside every compare: over a Qwen3 vocabulary row (151,936 entries) it took 0.77 ms in
// bf16, and 0.50 ms with the fp32 copy generate() takes first, on 2 cores of an AVX2 EPYC, against 0.04 ms here
// (benchmarks/cpu_decode_costs.py). Here a row is cut into one chunk per thread; each chunk finds its largest value 16
// entries at a time, then the first place it occurs. The answer is torch.argmax's: the first index of the largest
// value, or of the first NaN where a row has one.

#include <limits>
#include <vector>

#include <ATen/Parallel.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "moe_cpu.h"

namespace {

inline float to_float(float v) { return v; }
inline float to_float(c10::Half v) { return float(v); }
inline float to_float(c10::BFloat16 v) { return float(v); }

struct Best {
  float value;
  int64_t index;  // -1: an empty chunk
  bool nan;       // index is the chunk's first NaN
};

#if defined(__SSE2__)
// Four entries as fp32 lanes (SSE2, which every x86-64 CPU has: the pass is bound by reading the row).
inline __m128 load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 load4(const c10::BFloat16* p) {  // a bf16 is the top half of its fp32
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_unpacklo_epi16(_mm_setzero_si128(), h));
}
inline __m128 load4(const c10::Half* p) { return _mm_setr_ps(float(p[0]), float(p[1]), float(p[2]), float(p[3])); }
constexpr int64_t kLanes = 16;  // four vectors a step: independent maxima the core can overlap

// The largest value of [lo, hi) and whether it holds a NaN, 16 entries a step; `i` ends where the steps stop.
template <typename T>
float lanes_max(const T* x, int64_t lo, int64_t hi, int64_t& i, bool& nan) {
  __m128 top[4], bad = _mm_setzero_ps();
  for (auto& t : top) t = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  for (i = lo; i + kLanes <= hi; i += kLanes)
    for (int j = 0; j < 4; ++j) {
      const __m128 v = load4(x + i + 4 * j);
      top[j] = _mm_max_ps(v, top[j]);  // NaN-free lanes: the larger; a NaN is caught by `bad`
      bad = _mm_or_ps(bad, _mm_cmpunord_ps(v, v));
    }
  alignas(16) float lanes[16];
  for (int j = 0; j < 4; ++j) _mm_store_ps(lanes + 4 * j, top[j]);
  float m = -std::numeric_limits<float>::infinity();
  for (const float v : lanes) m = v > m ? v : m;
  nan = _mm_movemask_ps(bad) != 0;
  return m;
}

// Where the first entry of [lo, hi) equal to `top` (with `nan`: the first NaN) lies, to within its block of 16.
template <typename T>
int64_t first_block(const T* x, int64_t lo, int64_t hi, float top, bool nan) {
  const __m128 want = _mm_set1_ps(top);
  int64_t k = lo;
  for (; k + kLanes <= hi; k += kLanes) {
    int hit = 0;
    for (int j = 0; j < 4; ++j) {
      const __m128 v = load4(x + k + 4 * j);
      hit |= _mm_movemask_ps(nan ? _mm_cmpunord_ps(v, v) : _mm_cmpeq_ps(v, want));
    }
    if (hit) break;
  }
  return k;
}
#else
template <typename T>
float lanes_max(const T*, int64_t lo, int64_t, int64_t& i, bool& nan) {
  i = lo;
  nan = false;
  return -std::numeric_limits<float>::infinity();
}
template <typename T>
int64_t first_block(const T*, int64_t lo, int64_t, float, bool) {
  return lo;
}
#endif

// The first index of [lo, hi)'s largest value, or of its first NaN.
template <typename T>
Best chunk_best(const T* x, int64_t lo, int64_t hi) {
  int64_t i;
  bool nan;
  float top = lanes_max(x, lo, hi, i, nan);
  for (; i < hi; ++i) {
    const float v = to_float(x[i]);
    top = v > top ? v : top;
    nan |= v != v;
  }
  for (int64_t k = first_block(x, lo, hi, top, nan); k < hi; ++k) {
    const float v = to_float(x[k]);
    if (nan ? v != v : v == top) return {v, k, nan};
  }
  return {top, -1, false};  // only for an empty chunk
}

template <typename T>
void rows_argmax(const at::Tensor& logits, int64_t* out) {
  const int64_t rows = logits.size(0), V = logits.size(1);
  const T* base = logits.data_ptr<T>();
  constexpr int64_t kMinChunk = 8192;  // below this a thread's wake-up costs more than its share saves
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V / kMinChunk));
  const int64_t per = (V + chunks - 1) / chunks;
  std::vector<Best> best(rows * chunks);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      const int64_t row = c / chunks, lo = (c % chunks) * per;
      best[c] = chunk_best(base + row * V, lo, std::min(V, lo + per));
    }
  });
  for (int64_t row = 0; row < rows; ++row) {
    Best pick = best[row * chunks];
    for (int64_t c = 1; c < chunks; ++c) {  // chunks in order: a tie keeps the earlier index
      const Best& b = best[row * chunks + c];
      if (pick.nan || b.index < 0) continue;
      if (b.nan || b.value > pick.value) pick = b;
    }
    out[row] = pick.index;
  }
}

}  // namespace

at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.size(1) > 0,
              "greedy_tokens: logits must be a CPU tensor [rows, vocabulary] with a vocabulary");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({x.size(0)}, at::TensorOptions().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kFloat:
      rows_argmax<float>(x, out.data_ptr<int64_t>());
      break;
    case at::kBFloat16:
      rows_argmax<c10::BFloat16>(x, out.data_ptr<int64_t>());
      break;
    case at::kHalf:
      rows_argmax<c10::Half>(x, out.data_ptr<int64_t>());
      break;
    default:  // no model's logits: ATen's own loop
      return at::argmax(x, -1);
  }
  return out;
}
