// Decode attention of one (batch row, key / value head): the query heads that share that key / value head, one
// query each, over the cached positions its mask lets them see. Included by moe_cpu.cpp once per ISA level after
// rows_kernel.h (its vf, W, load, lane_sum and, at level 2, exp_lanes), like it; needs Attend and Fmt in scope.
//
// Each cached key and value row is read once for the whole group of query heads, and positions every head of the
// group is masked from are not read at all: a static cache's unfilled tail costs nothing.

// n values of a row in fmt (fp32, bf16 or fp16) as fp32.
inline void row_to_float(const uint8_t* src, Fmt f, int64_t n, float* dst) {
  if (f == Fmt::F32) {
    std::memcpy(dst, src, n * 4);
  } else if (f == Fmt::BF16) {
    const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const vu bits = __builtin_convertvector(load<vh>(s + i), vu) << 16;
      std::memcpy(dst + i, &bits, sizeof(vu));
    }
    for (; i < n; ++i) {
      const uint32_t bits = uint32_t(s[i]) << 16;
      std::memcpy(dst + i, &bits, 4);
    }
  } else {
    const c10::Half* s = reinterpret_cast<const c10::Half*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = float(s[i]);
  }
}

inline float vector_sum(vf v) {
#if HMOE_LEVEL == 2
  return _mm512_reduce_add_ps(__m512(v));
#else
  return lane_sum(v);
#endif
}

// W values of a row in fmt from column i, as fp32 (fp32 and bf16: one or two instructions; fp16 through a copy).
inline vf row_vector(const uint8_t* src, Fmt f, int64_t i) {
  if (f == Fmt::BF16) {
    const vu bits = __builtin_convertvector(load<vh>(src + 2 * i), vu) << 16;
    vf v;
    std::memcpy(&v, &bits, sizeof(v));
    return v;
  }
  if (f == Fmt::F32) return load<vf>(src + 4 * i);
  float tmp[W];
  row_to_float(src + 2 * i, f, W, tmp);
  return load<vf>(tmp);
}

// out[h] = q[h] . row for h < NH (query heads D apart, in fp32; the row in fmt): NH independent chains over the one
// row, which is read and widened once for all of them.
template <int NH>
inline void head_dots(const float* q, int64_t D, const uint8_t* row, Fmt f, float* out) {
  vf acc[NH] = {};
  int64_t i = 0;
  for (; i + W <= D; i += W) {
    const vf r = row_vector(row, f, i);
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) acc[h] += load<vf>(q + h * D + i) * r;
  }
  float tail[W];
  row_to_float(row + i * (f == Fmt::F32 ? 4 : 2), f, D - i, tail);
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    out[h] = vector_sum(acc[h]);
    for (int64_t c = i; c < D; ++c) out[h] += q[h * D + c] * tail[c - i];
  }
}

#if HMOE_LEVEL == 2 && defined(HMOE_BF16_DOTS)
// head_dots for bf16 query and key rows on AVX512-BF16 CPUs: one instruction multiplies 32 bf16 pairs (products exact
// in fp32) and sums them in fp32, where widening the key row and multiplying in fp32 took three times as many.
template <int NH>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void head_dots_bf16(const uint16_t* q, int64_t D,
                                                                                    const uint16_t* key, float* out) {
  __m512 acc[NH];
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
    const __m512bh k = __m512bh(_mm512_loadu_si512(key + i));
#pragma GCC unroll 4
    for (int h = 0; h < NH; ++h) acc[h] = _mm512_dpbf16_ps(acc[h], __m512bh(_mm512_loadu_si512(q + h * D + i)), k);
  }
#pragma GCC unroll 4
  for (int h = 0; h < NH; ++h) {
    out[h] = _mm512_reduce_add_ps(acc[h]);
    for (int64_t c = i; c < D; ++c)
      out[h] += float(c10::BFloat16(q[h * D + c], c10::BFloat16::from_bits())) *
                float(c10::BFloat16(key[c], c10::BFloat16::from_bits()));
  }
}
#endif

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

void attend(const Attend& a) {
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
  for (int64_t h = 0; h < G; ++h) row_to_float(a.q + h * a.q_stride, a.fmt, D, q + h * D);
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* key = a.k + seen[j] * a.k_stride;
    float dots[4];
    for (int64_t h = 0; h < G; h += 4) {
      const int64_t nh = std::min<int64_t>(4, G - h);
#if HMOE_LEVEL == 2 && defined(HMOE_BF16_DOTS)
      if (a.bf16_dots) {  // the query heads as given, in bf16 (a.q_stride: D of them apart, as head_dots_bf16 reads)
        const uint16_t* qh = reinterpret_cast<const uint16_t*>(a.q + h * a.q_stride);
        const uint16_t* k16 = reinterpret_cast<const uint16_t*>(key);
        if (nh == 4)
          head_dots_bf16<4>(qh, D, k16, dots);
        else
          for (int64_t i = 0; i < nh; ++i) head_dots_bf16<1>(qh + i * D, D, k16, dots + i);
      } else
#endif
          if (nh == 4)
        head_dots<4>(q + h * D, D, key, a.fmt, dots);
      else
        for (int64_t i = 0; i < nh; ++i) head_dots<1>(q + (h + i) * D, D, key, a.fmt, dots + i);
      for (int64_t i = 0; i < nh; ++i) {  // a hidden position is -inf whatever its key holds (inf, NaN)
        const float bias = a.bias(h + i, seen[j]);
        scores[(h + i) * n + j] = bias == -INFINITY ? -INFINITY : dots[i] * a.scale + bias;
      }
    }
  }
  for (int64_t h = 0; h < G; ++h) total[h] = exp_shifted(scores + h * n, n, row_max(scores + h * n, n));
  for (int64_t j0 = 0; j0 < n; j0 += chunk) {
    const int64_t m = std::min(chunk, n - j0);
    for (int64_t j = 0; j < m; ++j) row_to_float(a.v + seen[j0 + j] * a.v_stride, a.fmt, Dv, rows + j * Dv);
    for (int64_t h = 0; h < G; ++h) add_weighted(acc + h * Dv, scores + h * n + j0, rows, m, Dv);
  }
  // Normalised and rounded once; a head that may see no position gets 0 / 0 = NaN, as softmax over -inf gives.
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.f / total[h];
    uint8_t* out = a.out + h * a.out_stride;
    for (int64_t c = 0; c < Dv; ++c) {
      const float x = n ? acc[h * Dv + c] * inv : NAN;
      if (a.fmt == Fmt::F32)
        reinterpret_cast<float*>(out)[c] = x;
      else if (a.fmt == Fmt::BF16)
        reinterpret_cast<c10::BFloat16*>(out)[c] = c10::BFloat16(x);
      else
        reinterpret_cast<c10::Half*>(out)[c] = c10::Half(x);
    }
  }
}
