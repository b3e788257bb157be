// Decode attention of one (batch row, key / value head): the query heads that share that key / value head, one
// query each, over the cached positions its mask lets them see; and (AVX-512 level, bf16) prefill attention. Included
// by moe_cpu.cpp once per ISA level after rows_kernel.h (its load_step, dequant_rows, lane_sum and, at level 2,
// exp_lanes), like it; needs Attend, Matrix, and layout_pos in scope.
//
// Each cached key and value row is read once for the whole group of query heads, and positions every head of the
// group is masked from are not read at all: a static cache's unfilled tail costs nothing. bf16 scores come from the
// bf16 lanes where the CPU has them (lane_dots); the softmax and the value product stay in fp32 either way.

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

#if HMOE_LEVEL == 2
// Whether attend_as takes its scores from the bf16 lanes (lane_dots): bf16 queries and keys whose parts are whole
// 32-column steps, on a CPU with AVX512-BF16, keys of at least 512 columns (MLA's latent) and at least 8 query heads to
// share each laid-out key. Laying a key out (a 16 x 16 transpose of every 32 columns) costs about what a few heads'
// dot products over it cost in head_dots, and with the cache read from DRAM, as a decode step reads it, narrower keys
// did not gain (paired, 140 to 4,100 positions: 128-column keys of 32 / 8 heads 1.11-1.31x longer laid out, of 32 / 4
// 0.97-1.24x; MLA's 576-column keys, 8 heads a thread, 0.85-0.97x; 16 heads on one thread 0.68-0.78x;
// benchmarks/RESULTS.md, 2026-12-02).
constexpr int64_t kLaneMinHeads = 8, kLaneMinColumns = 512;
inline bool lane_dots_fit(const Attend& a) {
  return a.fmt == Fmt::BF16 && a.G >= kLaneMinHeads && a.D + a.D2 >= kLaneMinColumns && a.D % 32 == 0 &&
         a.D2 % 32 == 0 && bf16_lanes();
}

// dots[h * n + j] = query h . key seen[j] for h < G, j < n (n = seen's size) on the bf16 lanes (vdpbf16ps): 32
// positions' keys laid out as one panel (a split key's parts one after the other), each query's column pairs
// broadcast. Against head_dots, which widens each key a step at a time for 16 fp32 products an instruction and sums
// every head's vector across its lanes at every position, 32 bf16 products an instruction and no such sums (the whole
// op, 16 heads over DeepSeek-V2-Lite's 576-column latent keys on one thread: 0.68-0.78x its time; lane_dots_fit).
// bf16 products are exact in fp32; only the order of the sums differs.
void lane_dots(const Attend& a, const std::vector<int64_t>& seen, float* dots) {
  const int64_t n = int64_t(seen.size()), K = a.D + a.D2;
  thread_local std::vector<uint8_t> panel;  // a decode step's every call: kept, not allocated each time
  panel.resize(kBf16LaneRows * 2 * K);
  std::vector<const uint32_t*> qs(a.G);
  for (int64_t h = 0; h < a.G; ++h) qs[h] = reinterpret_cast<const uint32_t*>(a.q + h * a.q_stride);
  float res[kLaneTok * kBf16LaneRows];
  for (int64_t j0 = 0; j0 < n; j0 += kBf16LaneRows) {
    const int nr = int(std::min<int64_t>(kBf16LaneRows, n - j0));
    for (int half = 0; half < 2; ++half) {  // a short panel repeats its last position
      const uint8_t *rows[kLaneRows], *rows2[kLaneRows];
      for (int i = 0; i < kLaneRows; ++i) {
        const int64_t s = seen[j0 + std::min(kLaneRows * half + i, nr - 1)];
        rows[i] = a.k + s * a.k_stride;
        rows2[i] = a.D2 ? a.k2 + s * a.k2_stride : nullptr;
      }
      __m512i* out = reinterpret_cast<__m512i*>(panel.data()) + half * K / 2;
      bf16_pair_vectors(rows, 2 * a.D, out);
      if (a.D2) bf16_pair_vectors(rows2, 2 * a.D2, out + a.D / 2);
    }
    for (int64_t t = 0; t < a.G; t += kLaneTok) {
      const int nt = int(std::min<int64_t>(kLaneTok, a.G - t));
      lane_tokens(nt, [&](auto k) {
        bf16_lane_rows<decltype(k)::value>(panel.data(), K, qs.data() + t, Prefetch{nullptr, 0}, res);
      });
      for (int i = 0; i < nt; ++i) std::memcpy(dots + (t + i) * n + j0, res + i * kBf16LaneRows, nr * sizeof(float));
    }
  }
}

// x's lanes rounded to bf16, in the low half of each 32-bit lane: c10::BFloat16's rounding (to nearest even; NaN as
// 0x7FC0), 16 values an instruction sequence.
inline __m512i bf16_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, _mm512_set1_epi32(0x7FC0));
}
#endif

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
  const int64_t n = int64_t(seen.size()), G = a.G, D = a.D, D2 = a.D2, Dv = a.Dv;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / (4 * Dv));
  std::unique_ptr<float[]> buf(new float[G * (D + D2) + G * Dv + G + G * n + std::min(chunk, n) * Dv]);
  float *q = buf.get(), *q2 = q + G * D, *acc = q2 + G * D2, *total = acc + G * Dv, *scores = total + G,
        *rows = scores + G * n;
  std::fill(acc, acc + G * Dv, 0.f);
  std::vector<char> sees(G, 0);  // whether each head may see some position
#if HMOE_LEVEL == 2
  const bool lanes = lane_dots_fit(a);
#else
  constexpr bool lanes = false;
#endif
  if (lanes) {
#if HMOE_LEVEL == 2
    lane_dots(a, seen, scores);
#endif
  } else {
    // Query and value rows widened to fp32 as the expert kernel widens weight rows: in pairs_layout's column order
    // (a query's second part in its own: its key part is another row).
    const Matrix queries{a.q, nullptr, a.q_stride, D, D, F};
    dequant_rows(queries, 0, G, q);
    if (D2) dequant_rows(Matrix{a.q + D * (F == Fmt::F32 ? 4 : 2), nullptr, a.q_stride, D2, D2, F}, 0, G, q2);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* key = a.k + seen[j] * a.k_stride;
      const uint8_t* key2 = D2 ? a.k2 + seen[j] * a.k2_stride : nullptr;
      float dots[4], tail[4];
      for (int64_t h = 0; h < G; h += 4) {
        const int64_t nh = std::min<int64_t>(4, G - h);
        if (nh == 4) {
          head_dots<F, 4>(q + h * D, D, key, dots);
          if (D2) {
            head_dots<F, 4>(q2 + h * D2, D2, key2, tail);
            for (int i = 0; i < 4; ++i) dots[i] += tail[i];
          }
        } else {
          for (int64_t i = 0; i < nh; ++i) {
            head_dots<F, 1>(q + (h + i) * D, D, key, dots + i);
            if (D2) {
              head_dots<F, 1>(q2 + (h + i) * D2, D2, key2, tail);
              dots[i] += tail[0];
            }
          }
        }
        for (int64_t i = 0; i < nh; ++i) scores[(h + i) * n + j] = dots[i];
      }
    }
  }
  for (int64_t h = 0; h < G; ++h)
    for (int64_t j = 0; j < n; ++j) {  // a hidden position is -inf whatever its key holds (inf, NaN)
      const float bias = a.bias(h, seen[j]);
      sees[h] |= bias != -INFINITY;
      scores[h * n + j] = bias == -INFINITY ? -INFINITY : scores[h * n + j] * a.scale + bias;
    }
  for (int64_t h = 0; h < G; ++h) total[h] = exp_shifted(scores + h * n, n, row_max(scores + h * n, n));
  const Matrix values{a.v, nullptr, a.v_stride, Dv, Dv, F};
  for (int64_t j0 = 0; j0 < n; j0 += chunk) {
    const int64_t m = std::min(chunk, n - j0);
    for (int64_t j = 0; j < m; ++j) dequant_rows(values, seen[j0 + j], seen[j0 + j] + 1, rows + j * Dv);
    for (int64_t h = 0; h < G; ++h) add_weighted(acc + h * Dv, scores + h * n + j0, rows, m, Dv);
  }
  // Normalised, back in column order, and rounded once; a head that may see no position gets 0, as SDPA gives.
  for (int64_t h = 0; h < G; ++h) {
    const float inv = 1.f / total[h];
    uint8_t* out = a.out + h * a.out_stride;
    int64_t c = 0;
#if HMOE_LEVEL == 2
    if constexpr (F == Fmt::BF16) {
      // each 32-column step of acc holds its 16 even columns, then its 16 odd ones (pairs_layout): a pair of output
      // columns a 32-bit lane
      for (; sees[h] && c + 32 <= Dv; c += 32) {
        const __m512 scale = _mm512_set1_ps(inv);
        const __m512i even = bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(acc + h * Dv + c), scale));
        const __m512i odd = bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(acc + h * Dv + c + 16), scale));
        _mm512_storeu_si512(out + 2 * c, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
      }
    }
#endif
    for (; c < Dv; ++c) {
      const float x = sees[h] ? acc[h * Dv + layout_pos(c, Dv, F, kStep)] * inv : 0.f;
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

#if HMOE_LEVEL == 2
// Prefill attention of one (batch row, key / value head, block of queries) for bf16 q / k / v on CPUs with
// AVX512-BF16: the rows_kernel.h bf16 lanes do both products. Keys are laid out once per block as lane panels (32 keys
// a call, a query's column pairs broadcast): scores; values, pair of positions by pair, with their columns as lanes
// (32 columns a call, a query's probabilities broadcast as bf16 pairs): the output. Softmax in fp32 over the
// positions the block may see, its exponentials rounded to bf16 for the second product (as torch's flash attention
// for the CPU rounds them in bf16) and the sum kept in fp32. A query that may see no position gets 0, as SDPA gives.
struct AttendRows {
  const uint16_t* q;  // [G heads][L rows][D], strides in elements
  int64_t q_head, q_row;
  const uint16_t* k;  // [S][D], rows D apart
  const uint16_t* v;  // [S][Dv], rows Dv apart
  uint16_t* out;      // [L rows][G heads][Dv]
  int64_t out_row, out_head;
  int64_t G, L, S, D, Dv;
  float scale;
  MaskRef mask;
  bool causal;  // without a mask: position s for row l only if s <= l
  float bias(int64_t h, int64_t l, int64_t s) const {
    return mask.any() ? mask.bias(h, l, s) : causal && s > l ? -INFINITY : 0.f;
  }
};

// One past the last position row l of head h may see, at least `floor`: a search down from the end, 64 flags a
// compare for a boolean mask (a static cache's long hidden tail is searched for every row of a prompt).
inline int64_t seen_end(const AttendRows& a, int64_t h, int64_t l, int64_t floor) {
  if (!a.mask.any()) return std::max(floor, a.causal ? std::min(a.S, l + 1) : a.S);
  int64_t s = a.S;
  if (a.mask.flags && a.mask.pos == 1) {
    const bool* row = a.mask.flags + h * a.mask.head + l * a.mask.row;
    for (; s - 64 >= floor; s -= 64) {
      const __m512i flags = _mm512_loadu_si512(row + s - 64);
      const uint64_t seen = _mm512_test_epi8_mask(flags, flags);
      if (seen) return s - __builtin_clzll(seen);
    }
  }
  for (; s > floor; --s)
    if (a.bias(h, l, s - 1) != -INFINITY) return s;
  return floor;
}

// One worker's buffers for attend_rows: the block's keys and values laid out, its scores and probabilities.
struct RowsScratch {
  std::vector<uint8_t> keys, values;
  std::vector<float> scores;
  std::vector<uint32_t> probs;
};

// Rows [l0, l1) of every head of a.
inline void attend_rows(const AttendRows& a, int64_t l0, int64_t l1, RowsScratch& scratch) {
  const int64_t G = a.G, D = a.D, Dv = a.Dv, rows = G * (l1 - l0);
  int64_t n = 0;  // positions [0, n): up to the last one some row of the block may see
  for (int64_t h = 0; h < G; ++h)
    for (int64_t l = l0; l < l1; ++l) n = seen_end(a, h, l, n);
  const int64_t n_pad = (n + 1) & ~int64_t(1);  // whole pairs of positions for the second product
  std::vector<uint8_t>& keys = scratch.keys;    // plain references (not a structured binding): lambdas below use them
  std::vector<uint8_t>& values = scratch.values;
  std::vector<float>& scores = scratch.scores;
  std::vector<uint32_t>& probs = scratch.probs;
  const Matrix kmat{reinterpret_cast<const uint8_t*>(a.k), nullptr, 2 * D, D, D, Fmt::BF16};
  keys.resize((n + kBf16LaneRows - 1) / kBf16LaneRows * kBf16LaneRows * 2 * D);
  for (int64_t r = 0; r < n; r += kBf16LaneRows)
    bf16_lane_panel(kmat, r, int(std::min<int64_t>(kBf16LaneRows, n - r)), keys.data() + r * 2 * D);
  // values: for each group of 32 columns, two halves of 16, each n_pad / 2 vectors: (v[2p][c], v[2p + 1][c]) per lane
  values.resize(Dv / kBf16LaneRows * kBf16LaneRows * n_pad * 2);
  uint32_t* vp = reinterpret_cast<uint32_t*>(values.data());
  for (int64_t c0 = 0; c0 < Dv; c0 += kLaneRows)
    for (int64_t p = 0; p < n_pad / 2; ++p) {
      const __m512i even =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.v + 2 * p * Dv + c0)));
      const __m512i odd =
          2 * p + 1 < n
              ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.v + (2 * p + 1) * Dv + c0)))
              : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (c0 / kLaneRows * n_pad / 2 + p) * kLaneRows,
                          _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
  scores.resize(rows * n);
  probs.resize(rows * n_pad / 2);
  std::vector<const uint32_t*> qs(rows), ps(rows);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t l = l0; l < l1; ++l) {
      const int64_t i = h * (l1 - l0) + (l - l0);
      qs[i] = reinterpret_cast<const uint32_t*>(a.q + h * a.q_head + l * a.q_row);
      ps[i] = probs.data() + i * n_pad / 2;
    }
  float res[kLaneTok * kBf16LaneRows];
  for (int64_t r = 0; r < n; r += kBf16LaneRows) {
    const int nr = int(std::min<int64_t>(kBf16LaneRows, n - r));
    for (int64_t t = 0; t < rows; t += kLaneTok) {
      const int nt = int(std::min<int64_t>(kLaneTok, rows - t));
      lane_tokens(nt, [&](auto k) {
        bf16_lane_rows<decltype(k)::value>(keys.data() + r * 2 * D, D, qs.data() + t, Prefetch{nullptr, 0}, res);
      });
      for (int j = 0; j < nt; ++j)
        std::memcpy(scores.data() + (t + j) * n + r, res + j * kBf16LaneRows, nr * sizeof(float));
    }
  }
  std::vector<float> total(rows);
  for (int64_t h = 0; h < G; ++h)
    for (int64_t l = l0; l < l1; ++l) {
      const int64_t i = h * (l1 - l0) + (l - l0);
      float* s = scores.data() + i * n;
      bool seen = false;
      for (int64_t j = 0; j < n; ++j) {  // a hidden position is -inf whatever its key holds (inf, NaN)
        const float bias = a.bias(h, l, j);
        seen |= bias != -INFINITY;
        s[j] = bias == -INFINITY ? -INFINITY : s[j] * a.scale + bias;
      }
      if (!seen)  // a row that may see nothing: 0, as SDPA gives (a NaN among seen scores stays NaN)
        std::fill(s, s + n, 0.f);
      total[i] = seen ? exp_shifted(s, n, row_max(s, n)) : 0.f;
      uint16_t* p = reinterpret_cast<uint16_t*>(probs.data() + i * n_pad / 2);
      for (int64_t j = 0; j < n; ++j) p[j] = c10::detail::round_to_nearest_even(s[j]);
      if (n_pad > n) p[n] = 0;
    }
  for (int64_t c0 = 0; c0 < Dv; c0 += kBf16LaneRows) {
    const uint8_t* panel = values.data() + c0 * n_pad * 2;
    for (int64_t t = 0; t < rows; t += kLaneTok) {
      const int nt = int(std::min<int64_t>(kLaneTok, rows - t));
      lane_tokens(nt, [&](auto k) {
        bf16_lane_rows<decltype(k)::value>(panel, n_pad, ps.data() + t, Prefetch{nullptr, 0}, res);
      });
      for (int j = 0; j < nt; ++j) {
        const int64_t i = t + j, h = i / (l1 - l0), l = l0 + i % (l1 - l0);
        const float inv = total[i] == 0.f ? 0.f : 1.f / total[i];
        uint16_t* o = a.out + l * a.out_row + h * a.out_head + c0;
        for (int c = 0; c < kBf16LaneRows; ++c)
          o[c] = c10::detail::round_to_nearest_even(res[j * kBf16LaneRows + c] * inv);
      }
    }
  }
}
#endif
