// Decode attention of one (batch row, key / value head): the query heads that share that key / value head, one
// query each, over the cached positions its mask lets them see. Included by moe_cpu.cpp once per ISA level after
// rows_kernel.h (its load_step, dequant_rows, lane_sum and, at level 2, exp_lanes), like it; needs Attend, Matrix,
// and layout_pos in scope.
//
// Each cached key and value row is read once for the whole group of query heads, and positions every head of the
// group is masked from are not read at all: a static cache's unfilled tail costs nothing.

inline float vector_sum(vf v) {
#if HMOE_LEVEL == 2
  return _mm512_reduce_add_ps(__m512(v));
#else
  return lane_sum(v);
#endif
}

// out[h] = q[h] . key for h < NH: the query heads D apart in fp32, laid out as dequant_rows lays out a row of F
// (pairs_layout); the key row widened a step at a time by load_step, once for all NH chains.
template <Fmt F, int NH>
inline void head_dots(const float* q, int64_t D, const uint8_t* key, float* out) {
  vf acc[NH] = {};
  const int64_t full = D / kStep * kStep;
  for (int64_t k = 0; k < full; k += kStep) {
    vf lo, hi;
    load_step<F>(key, k, lo, hi);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) acc[h] += load<vf>(q + h * D + k) * lo + load<vf>(q + h * D + k + W) * hi;
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    out[h] = vector_sum(acc[h]);
    for (int64_t k = full; k < D; ++k) out[h] += q[h * D + k] * weight_at_fmt<F>(key, k, 1.f);
  }
}

// Vectors of a column slice summed in registers over a chunk's rows (as many as the register file holds beside them).
constexpr int kSliceVectors = HMOE_VBYTES >= 64 ? 8 : 4;

// acc[c] += sum_j p[j] * rows[j * n + c] for c < n, j < m: each slice of columns in registers over all m rows.
inline void add_weighted(float* acc, const float* p, const float* rows, int64_t m, int64_t n) {
  int64_t c = 0;
  for (; c + kSliceVectors * W <= n; c += kSliceVectors * W) {
    vf sum[kSliceVectors];
#pragma GCC unroll 8
    for (int v = 0; v < kSliceVectors; ++v) sum[v] = load<vf>(acc + c + v * W);
    for (int64_t j = 0; j < m; ++j) {
      const vf pj = vf{} + p[j];
      const float* row = rows + j * n + c;
#pragma GCC unroll 8
      for (int v = 0; v < kSliceVectors; ++v) sum[v] += pj * load<vf>(row + v * W);
    }
    std::memcpy(acc + c, sum, sizeof(sum));
  }
  for (; c + W <= n; c += W) {
    vf sum = load<vf>(acc + c);
    for (int64_t j = 0; j < m; ++j) sum += (vf{} + p[j]) * load<vf>(rows + j * n + c);
    std::memcpy(acc + c, &sum, sizeof(sum));
  }
  for (; c < n; ++c)
    for (int64_t j = 0; j < m; ++j) acc[c] += p[j] * rows[j * n + c];
}

// The largest of s[j], j < n (-inf for none), in vectors: a scalar running max is one long chain of dependent maxes.
inline float row_max(const float* s, int64_t n) {
  vf top = vf{} - INFINITY;
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const vf x = load<vf>(s + j);
    top = x > top ? x : top;
  }
  float m = -INFINITY;
  for (int l = 0; l < W; ++l) m = std::max(m, top[l]);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] = exp(s[j] - top) for j < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float top) {
  float sum = 0.f;
#if HMOE_LEVEL == 2
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(top)));
    _mm512_mask_storeu_ps(s + j, m, e);
    acc = _mm512_mask_add_ps(acc, m, acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#else
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - top));
#endif
  return sum;
}

// Bytes of value rows converted to fp32 at a time: the query heads then read them from L1, one after another (from L2
// each head's pass over them was bound by L2's bandwidth).
constexpr int64_t kChunkBytes = 16384;

template <Fmt F>
void attend_as(const Attend& a) {
  std::vector<int64_t> seen;  // positions some head of the group may see
  seen.reserve(a.S);
  for (int64_t s = 0; s < a.S; ++s)
    for (int64_t h = 0; h < a.G; ++h)
      if (a.bias(h, s) != -INFINITY) {
        seen.push_back(s);
        break;
      }
  const int64_t n = int64_t(seen.size()), G = a.G, D = a.D, Dv = a.Dv;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (4 * Dv));
  std::unique_ptr<float[]> buf(new float[G * D + G * Dv + G + G * n + std::min(chunk, n) * Dv]);
  float *q = buf.get(), *acc = q + G * D, *total = acc + G * Dv, *scores = total + G, *rows = scores + G * n;
  std::fill(acc, acc + G * Dv, 0.f);
  // Query and value rows widened to fp32 as the expert kernel widens weight rows: in pairs_layout's column order.
  const Matrix queries{a.q, nullptr, a.q_stride, D, D, F}, values{a.v, nullptr, a.v_stride, Dv, Dv, F};
  dequant_rows(queries, 0, G, q);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* key = a.k + seen[j] * a.k_stride;
    float dots[4];
    for (int64_t h = 0; h < G; h += 4) {
      const int64_t nh = std::min<int64_t>(4, G - h);
      if (nh == 4)
        head_dots<F, 4>(q + h * D, D, key, dots);
      else
        for (int64_t i = 0; i < nh; ++i) head_dots<F, 1>(q + (h + i) * D, D, key, dots + i);
      for (int64_t i = 0; i < nh; ++i) {  // a hidden position is -inf whatever its key holds (inf, NaN)
        const float bias = a.bias(h + i, seen[j]);
        scores[(h + i) * n + j] = bias == -INFINITY ? -INFINITY : dots[i] * a.scale + bias;
      }
    }
  }
  for (int64_t h = 0; h < G; ++h) total[h] = exp_shifted(scores + h * n, n, row_max(scores + h * n, n));
  for (int64_t j0 = 0; j0 < n; j0 += chunk) {
    const int64_t m = std::min(chunk, n - j0);
    for (int64_t j = 0; j < m; ++j) dequant_rows(values, seen[j0 + j], seen[j0 + j] + 1, rows + j * Dv);
    for (int64_t h = 0; h < G; ++h) add_weighted(acc + h * Dv, scores + h * n + j0, rows, m, Dv);
  }
  // Normalised, back in column order, and rounded once; a head that may see no position gets 0 / 0 = NaN, as softmax
  // over -inf gives.
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.f / total[h];
    uint8_t* out = a.out + h * a.out_stride;
    for (int64_t c = 0; c < Dv; ++c) {
      const float x = n ? acc[h * Dv + layout_pos(c, Dv, F, kStep)] * inv : NAN;
      if constexpr (F == Fmt::F32)
        reinterpret_cast<float*>(out)[c] = x;
      else if constexpr (F == Fmt::BF16)
        reinterpret_cast<c10::BFloat16*>(out)[c] = c10::BFloat16(x);
      else
        reinterpret_cast<c10::Half*>(out)[c] = c10::Half(x);
    }
  }
}

void attend(const Attend& a) {
  if (a.fmt == Fmt::F32) return attend_as<Fmt::F32>(a);
  if (a.fmt == Fmt::BF16) return attend_as<Fmt::BF16>(a);
  attend_as<Fmt::F16>(a);
}
