// The micro-kernels, written once with GCC vector extensions and included by moe_cpu.cpp once per ISA level,
// each time inside its own namespace, under `#pragma GCC target`, with HMOE_VBYTES (vector bytes) and HMOE_LEVEL
// set: the same source becomes SSE2, AVX2 or AVX-512 code. Needs Fmt, Matrix, weight_at and <cstring> in scope.

constexpr int W = HMOE_VBYTES / 4;  // fp32 lanes per vector
constexpr int kStep = 2 * W;        // columns per inner step: two vectors
// Tokens per micro-kernel call: kRows x kTok accumulators plus kTok activations must fit the register file.
constexpr int kTok = HMOE_VBYTES >= 64 ? 4 : 2;

typedef float vf __attribute__((vector_size(HMOE_VBYTES)));
typedef uint32_t vu __attribute__((vector_size(HMOE_VBYTES)));

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// Columns [k, k + kStep) of one weight row as two fp32 vectors, unscaled (int8 / int4: q itself). bf16 and int4 come out as (even columns, odd columns): two bf16 or two nibbles share 32 or
// 8 bits, and splitting them in place costs one shift and one mask, no shuffle. Their activations are
// laid out to match (see pairs_layout).
template <Fmt F>
inline void load_step(const uint8_t* row, int64_t k, vf& lo, vf& hi) {
#if HMOE_LEVEL == 2
  if constexpr (F == Fmt::F32) {
    lo = vf(_mm512_loadu_ps(row + 4 * k));
    hi = vf(_mm512_loadu_ps(row + 4 * k + 64));
  } else if constexpr (F == Fmt::BF16) {
    const __m512i v = _mm512_loadu_si512(row + 2 * k);
    lo = vf(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    hi = vf(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u)))));
  } else if constexpr (F == Fmt::F16) {
    lo = vf(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k))));
    hi = vf(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k + 32))));
  } else if constexpr (F == Fmt::I8) {
    lo = vf(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k)))));
    hi = vf(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k + 16)))));
  } else {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2)));
    const __m512i eight = _mm512_set1_epi32(8);
    lo = vf(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(15)), eight)));
    hi = vf(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight)));
  }
#elif HMOE_LEVEL == 1
  if constexpr (F == Fmt::F32) {
    lo = vf(_mm256_loadu_ps(reinterpret_cast<const float*>(row) + k));
    hi = vf(_mm256_loadu_ps(reinterpret_cast<const float*>(row) + k + 8));
  } else if constexpr (F == Fmt::BF16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * k));
    lo = vf(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    hi = vf(_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u)))));
  } else if constexpr (F == Fmt::F16) {
    lo = vf(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k))));
    hi = vf(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * k + 16))));
  } else if constexpr (F == Fmt::I8) {
    lo = vf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k)))));
    hi = vf(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k + 8)))));
  } else {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2)));
    const __m256i eight = _mm256_set1_epi32(8);
    lo = vf(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(15)), eight)));
    hi = vf(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight)));
  }
#else
  if constexpr (F == Fmt::BF16) {
    const vu v = load<vu>(row + 2 * k);
    lo = reinterpret_cast<vf>(v << 16);
    hi = reinterpret_cast<vf>(v & 0xFFFF0000u);
  } else {  // portable fallback, one element at a time, in the same column order as the vector levels
    for (int l = 0; l < W; ++l) {
      const bool pairs = F == Fmt::I4;
      lo[l] = weight_at_fmt<F>(row, pairs ? k + 2 * l : k + l, 1.f);
      hi[l] = weight_at_fmt<F>(row, pairs ? k + 2 * l + 1 : k + W + l, 1.f);
    }
  }
#endif
}

inline float lane_sum(vf v) {
  float s = 0.f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

// res[t * kRows + i] = row (r0 + i) of m . xs[t] for i < nr, t < NT; activations are fp32.
template <Fmt F, int NT>
void rows_dot(const Matrix& m, int64_t r0, int nr, const void* const* xs, float* res) {
  const uint8_t* rows[kRows];
  const float* scales[kRows];
  for (int i = 0; i < kRows; ++i) {
    const int64_t r = r0 + std::min(i, nr - 1);  // a short block repeats its last row; those results are dropped
    rows[i] = m.row(r);
    scales[i] = m.row_scale(r);
  }
  const float* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const float*>(xs[t]);
  vf acc[kRows][NT] = {};
  // Rows are often exactly a page (2048 bf16), where hardware prefetchers stop and restart: the rows of the
  // next call (contiguous, right after these) are fetched at the pace these are read, one step's worth each step.
  constexpr int64_t step_bytes = kRows * kStep * bits_of(F) / 8;
  const uint8_t* next = m.row(r0 + kRows);
  const int64_t full = m.K / kStep * kStep;
  const int64_t group = m.scale ? m.group : std::max<int64_t>(full, 1);  // quantised: K % group == 0, group % 32 == 0
  for (int64_t g0 = 0; g0 < full; g0 += group) {
    // Sum q * x over the group, then scale once: no multiply per weight.
    vf part[kRows][NT] = {};
    for (int64_t k = g0; k < g0 + group; k += kStep) {
      for (int64_t b = 0; b < step_bytes; b += 64) __builtin_prefetch(next + k / kStep * step_bytes + b);
      vf xlo[NT], xhi[NT];
      for (int t = 0; t < NT; ++t) {
        xlo[t] = load<vf>(x[t] + k);
        xhi[t] = load<vf>(x[t] + k + W);
      }
      for (int i = 0; i < kRows; ++i) {
        vf lo, hi;
        load_step<F>(rows[i], k, lo, hi);
        for (int t = 0; t < NT; ++t) {
          part[i][t] += lo * xlo[t];
          part[i][t] += hi * xhi[t];
        }
      }
    }
    for (int i = 0; i < kRows; ++i) {
      const float s = scales[i] ? scales[i][g0 / group] : 1.f;
      for (int t = 0; t < NT; ++t) acc[i][t] += part[i][t] * s;
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < nr; ++i) {
      float s = lane_sum(acc[i][t]);
      for (int64_t k = full; k < m.K; ++k) s += weight_at(m, rows[i], scales[i], k) * x[t][k];
      res[t * kRows + i] = s;
    }
}

template <Fmt F>
void rows_dispatch(const Matrix& m, int64_t r0, int nr, const void* const* xs, int nt, float* res) {
  switch (nt) {
    case 1: return rows_dot<F, 1>(m, r0, nr, xs, res);
    case 2: return rows_dot<F, 2>(m, r0, nr, xs, res);
    case 3: if constexpr (kTok >= 3) return rows_dot<F, 3>(m, r0, nr, xs, res); break;
    case 4: if constexpr (kTok >= 4) return rows_dot<F, 4>(m, r0, nr, xs, res); break;
  }
}

// dst[t * ld + (r - r0)] = row r of m . xs[t] for rows [r0, r1) and tokens [0, n).
void matvec_block(const Matrix& m, int64_t r0, int64_t r1, const void* const* xs, int64_t n, float* dst, int64_t ld) {
  float res[kTok * kRows];
  for (int64_t r = r0; r < r1; r += kRows) {
    const int nr = int(std::min<int64_t>(kRows, r1 - r));
    for (int64_t t = 0; t < n; t += kTok) {
      const int nt = int(std::min<int64_t>(kTok, n - t));
      switch (m.fmt) {
        case Fmt::F32: rows_dispatch<Fmt::F32>(m, r, nr, xs + t, nt, res); break;
        case Fmt::BF16: rows_dispatch<Fmt::BF16>(m, r, nr, xs + t, nt, res); break;
        case Fmt::F16: rows_dispatch<Fmt::F16>(m, r, nr, xs + t, nt, res); break;
        case Fmt::I8: rows_dispatch<Fmt::I8>(m, r, nr, xs + t, nt, res); break;
        case Fmt::I4: rows_dispatch<Fmt::I4>(m, r, nr, xs + t, nt, res); break;
      }
      for (int j = 0; j < nt; ++j)
        for (int i = 0; i < nr; ++i) dst[(t + j) * ld + (r - r0) + i] = res[j * kRows + i];
    }
  }
}

// Rows [r0, r1) of m as fp32 into dst (row-major), columns in the same order as the micro-kernels read
// them (pairs_layout): the weight panel a GEMM multiplies by equally laid-out activations.
template <Fmt F>
void dequant_rows_as(const Matrix& m, int64_t r0, int64_t r1, float* dst) {
  const int64_t full = m.K / kStep * kStep;
  const int64_t group = m.scale ? m.group : std::max<int64_t>(full, 1);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = m.row(r);
    const float* scales = m.row_scale(r);
    float* out = dst + (r - r0) * m.K;
    for (int64_t g0 = 0; g0 < full; g0 += group) {
      const float s = scales ? scales[g0 / group] : 1.f;
      for (int64_t k = g0; k < g0 + group; k += kStep) {
        vf lo, hi;
        load_step<F>(row, k, lo, hi);
        lo *= s;
        hi *= s;
        std::memcpy(out + k, &lo, sizeof(vf));
        std::memcpy(out + k + W, &hi, sizeof(vf));
      }
    }
    for (int64_t k = full; k < m.K; ++k) out[k] = weight_at(m, row, scales, k);
  }
}

void dequant_rows(const Matrix& m, int64_t r0, int64_t r1, float* dst) {
  switch (m.fmt) {
    case Fmt::F32: return dequant_rows_as<Fmt::F32>(m, r0, r1, dst);
    case Fmt::BF16: return dequant_rows_as<Fmt::BF16>(m, r0, r1, dst);
    case Fmt::F16: return dequant_rows_as<Fmt::F16>(m, r0, r1, dst);
    case Fmt::I8: return dequant_rows_as<Fmt::I8>(m, r0, r1, dst);
    case Fmt::I4: return dequant_rows_as<Fmt::I4>(m, r0, r1, dst);
  }
}
