// The micro-kernels, written once with GCC vector extensions and included by moe_cpu.cpp once per ISA level,
// each time inside its own namespace, under `#pragma GCC target`, with HMOE_VBYTES (vector bytes) and HMOE_LEVEL
// set: the same source becomes SSE2, AVX2 or AVX-512 code. Needs Fmt, Matrix, QuantRecord, weight_at, pairs_layout,
// record_pos, layout_pos, quantise_row, inverse_scale, <cmath>, <cstring>, <type_traits> and <vector> in scope.

constexpr int W = HMOE_VBYTES / 4;  // fp32 lanes per vector
constexpr int kStep = 2 * W;        // columns per inner step: two vectors
static_assert((kStep & (kStep - 1)) == 0, "layout_pos masks with kStep");
// Tokens per micro-kernel call: kRows x kTok accumulators plus kTok activations must fit the register file.
constexpr int kTok = HMOE_VBYTES >= 64 ? 4 : 2;

// What the AVX2 int4 micro-kernel reads of each token besides its QuantRecord, prepared once per matvec_block call
// (i4_lanes); the other levels and formats are passed null.
struct I4Lanes {
  const float* scale;      // [K / 64 steps][8]: lanes 0-3 the first block's activation scale, 4-7 the second's
  const float* group_sum;  // [K / group]: the activations' sum over each weight group
};

// Lines of the next panel's rows for one dot call to prefetch, spread over its loop (up to as many a step as the step
// reads of the panel), while it reads the panel in cache.
struct Prefetch {
  const uint8_t* at;
  int64_t lines;
};

typedef float vf __attribute__((vector_size(HMOE_VBYTES)));
typedef uint32_t vu __attribute__((vector_size(HMOE_VBYTES)));

template <typename V>
inline V load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// Columns [k, k + kStep) of one weight row as two fp32 vectors, unscaled (int8 / int4: q itself). bf16 and int4 come
// out as (even columns, odd columns): two bf16 or two nibbles share 32 or 8 bits, and splitting them in place costs one
// shift and one mask, no shuffle. Their activations are laid out to match (see pairs_layout).
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

// res[t * kRows + i] = row (r0 + i) of m . xs[t] for i < nr, t < NT; float formats, fp32 activations. `next`: the
// rows to prefetch while these are read (the next call's).
template <Fmt F, int NT>
void rows_dot(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, float* res) {
  const uint8_t* rows[kRows];
  for (int i = 0; i < kRows; ++i) rows[i] = m.row(r0 + std::min(i, nr - 1));  // a short block repeats its last row
  const float* x[NT];
  for (int t = 0; t < NT; ++t) x[t] = static_cast<const float*>(xs[t]);
  vf acc[kRows][NT] = {};
  // Rows are often exactly a page (2048 bf16), where hardware prefetchers stop and restart: the rows of the
  // next call (contiguous, right after these) are fetched at the pace these are read, one step's worth each step.
  constexpr int64_t step_bytes = kRows * kStep * bits_of(F) / 8;
  const int64_t full = m.K / kStep * kStep;
  for (int64_t k = 0; k < full; k += kStep) {
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
        acc[i][t] += lo * xlo[t];
        acc[i][t] += hi * xhi[t];
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < nr; ++i) {
      float s = lane_sum(acc[i][t]);
      for (int64_t k = full; k < m.K; ++k) s += weight_at(m, rows[i], nullptr, k) * x[t][k];
      res[t * kRows + i] = s;
    }
}

// Row panels and token chunks of matvec_block: a panel's rows stay in L2 while every chunk of tokens passes over
// them, and a chunk's activations stay in L2 while the panel's rows pass over it. Taking all tokens per row block
// instead, 128 or more tokens' activations left L2 and two threads at 128-512 tokens ran at 55-57 GMAC/s against
// 70-76 at 32 tokens (AVX2 int4; benchmarks/RESULTS.md, 2026-11-27 late).
constexpr int64_t kPanelBytes = 64 << 10, kTokenChunkBytes = 128 << 10;

// The same for int8 / int4 weights and quantised activation records (QuantRecord): integer products summed
// exactly per 32-column block, then scaled by the activation block's scale and by the weight's group scale.
// int4 multiplies the stored q + 8 and takes 8 * sum(activations) off again: per block at the AVX-512 level, per
// weight group after the loop at the AVX2 level.
#if HMOE_LEVEL >= 1
// n fp16 values as fp32.
inline void widen_halves(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
#if HMOE_LEVEL == 2
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#else
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// One call's operands: kRows weight rows and their group scales (fp32), NT activation records.
template <int NT>
struct QuantOperands {
  const uint8_t* rows[kRows];
  const float* scales[kRows];
  QuantRecord x[NT];
  const uint8_t* next;  // the rows of the next call (rows of m), prefetched at the pace these are read
  static constexpr int64_t kInlineGroups = 64;
  float inline_scales[kRows * kInlineGroups];

  QuantOperands(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs) : next(next) {
    // The rows' fp16 scales widened to fp32 once a call (the loops read fp32): here up to kInlineGroups a row, with
    // no thread-local lookup a call (short rows make many calls: MLA's 512-column value rows 512 an op), else in this
    // thread's buffer.
    const int64_t groups = m.K / m.group;
    float* widened = inline_scales;
    if (groups > kInlineGroups) {
      thread_local std::vector<float> spilled;
      spilled.resize(kRows * groups);
      widened = spilled.data();
    }
    for (int i = 0; i < kRows; ++i) {
      const int64_t r = r0 + std::min(i, nr - 1);  // a short block repeats its last row
      rows[i] = m.row(r);
      scales[i] = widened + std::min(i, nr - 1) * groups;
      if (i < nr) widen_halves(m.row_scale(r), groups, widened + i * groups);
    }
    // The next call's scales, as its rows are prefetched: they are read all at once at its start.
    const int64_t next_row = (next - m.data) / m.row_bytes;
    const uint8_t* next_scales = reinterpret_cast<const uint8_t*>(m.row_scale(next_row));
    for (int64_t o = 0; o < kRows * groups * 2; o += 64) __builtin_prefetch(next_scales + o);
    for (int t = 0; t < NT; ++t) x[t] = QuantRecord(xs[t], m.K);
  }

  // The 32 int8 values at block position b of each record, and each block's scale broadcast.
  void block(int64_t b, __m256i* q, __m256* scale) const {
    for (int t = 0; t < NT; ++t) {
      q[t] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[t].q + 32 * b));
      scale[t] = _mm256_set1_ps(x[t].scale[b]);
    }
  }
};
#endif

#if HMOE_LEVEL == 2
// AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes and sums each 4 products into an int32 lane, 64 bytes
// per instruction. Weights go in unsigned (int4 as stored, q + 8; int8 with its sign bit flipped, q + 128) and
// each lane's sum starts at -offset x the activation bytes it multiplies, so the offset comes off in int32, exactly
// (in float, after the conversion, it cost an int8 identity its bit-exact output). One step
// reads 64 bytes of a row: int8, two blocks of 8 lanes; int4, four blocks of 4 lanes (the low nibbles hold the
// even columns, the high nibbles the odd ones, and each pair of blocks' record has its even columns first).
template <Fmt F>
constexpr int64_t kStepBlocks = F == Fmt::I8 ? 2 : 4;

// The 16 lanes of a step: lane l gets v[l / (16 / Blocks)], the value of its block.
template <int64_t Blocks>
inline __m512 block_lanes(const float* v) {
  if constexpr (Blocks == 2) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(
        idx,
        _mm512_castps256_ps512(_mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(v))))));
  } else {
    const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(v)));
  }
}

// A row's weight scales for the blocks [b, b + Blocks) of a step, one per lane (groups of per_group blocks). The
// usual groups load their scales straight into lanes (a vector load of values just stored one by one would stall).
template <int64_t Blocks>
inline __m512 scale_lanes(const float* scales, int64_t b, int64_t per_group) {
  if (per_group % Blocks == 0) return _mm512_set1_ps(scales[b / per_group]);
  if (per_group == 1) return block_lanes<Blocks>(scales + b);
  if (Blocks == 4 && per_group == 2) return block_lanes<2>(scales + b / 2);
  float v[Blocks];
  for (int64_t j = 0; j < Blocks; ++j) v[j] = scales[(b + j) / per_group];
  return block_lanes<Blocks>(v);
}

// 32 bytes at lo, then 32 at hi.
inline __m512i halves(const int8_t* lo, const int8_t* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

// The scales of blocks [b, b + 2) of an int4 row in lanes 0-7 and zeros above: the last pair's half step, whose
// next two blocks' scales are past the row (past the tensor, for its last row).
inline __m512 pair_scale_lanes(const float* scales, int64_t b, int64_t per_group) {
  const float v[4] = {scales[b / per_group], scales[(b + 1) / per_group], 0.f, 0.f};
  return block_lanes<4>(v);
}

template <Fmt F, int NT>
void rows_dot_q(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, const I4Lanes*,
                float* res) {
  constexpr int64_t B = kStepBlocks<F>;
  const QuantOperands<NT> w(m, r0, nr, next, xs);
  const int64_t blocks = m.K / 32, per_group = m.group / 32;
  const __m512i nibble = _mm512_set1_epi8(15), sign = _mm512_set1_epi8(char(0x80));
  const __m512i offset = _mm512_set1_epi8(char(F == Fmt::I8 ? 128 : 8)), zero = _mm512_setzero_si512();
  __m512 acc[kRows][NT];
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  // One step at block b: a full one, or (Pair, int4 only) the row's last pair of blocks in the lower half of the
  // registers, the upper half zero: K % 128 == 64, as DeepSeek's 10,944-wide dense MLP, whose last pair summed one
  // element at a time cost a third of that projection's time (benchmarks/RESULTS.md, 2026-12-01).
  const auto step = [&](int64_t b, auto pair) {
    constexpr bool Pair = decltype(pair)::value;
    constexpr __mmask64 lower = 0xFFFFFFFFull;
    __m512i lo_x[NT], hi_x[NT], x_start[NT];
    __m512 x_scale[NT];
    for (int t = 0; t < NT; ++t) {
      const int8_t* q = w.x[t].q + 32 * b;
      if constexpr (F == Fmt::I8) {
        lo_x[t] = _mm512_loadu_si512(q);
      } else if constexpr (Pair) {  // the pair's even columns, then its odd ones
        lo_x[t] = _mm512_maskz_loadu_epi8(lower, q);
        hi_x[t] = _mm512_maskz_loadu_epi8(lower, q + 32);
      } else {  // the even columns of this step's two pairs of blocks, then their odd columns
        lo_x[t] = halves(q, q + 64);
        hi_x[t] = halves(q + 32, q + 96);
      }
      if constexpr (Pair) {
        const float v[4] = {w.x[t].scale[b], w.x[t].scale[b + 1], 0.f, 0.f};
        x_scale[t] = block_lanes<4>(v);
      } else {
        x_scale[t] = block_lanes<B>(w.x[t].scale + b);
      }
      __m512i taken = _mm512_dpbusd_epi32(zero, offset, lo_x[t]);
      if constexpr (F == Fmt::I4) taken = _mm512_dpbusd_epi32(taken, offset, hi_x[t]);
      x_start[t] = _mm512_sub_epi32(zero, taken);
    }
    for (int i = 0; i < kRows; ++i) {
      const __m512 s = Pair ? pair_scale_lanes(w.scales[i], b, per_group) : scale_lanes<B>(w.scales[i], b, per_group);
      const uint8_t* row = w.rows[i] + 64 * b / B;
      const __m512i v = Pair ? _mm512_maskz_loadu_epi8(lower, row) : _mm512_loadu_si512(row);
      __m512i lo, hi;
      if constexpr (F == Fmt::I8) {
        lo = _mm512_xor_si512(v, sign);
      } else {
        lo = _mm512_and_si512(v, nibble);
        hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
      for (int t = 0; t < NT; ++t) {
        __m512i d = _mm512_dpbusd_epi32(x_start[t], lo, lo_x[t]);
        if constexpr (F == Fmt::I4) d = _mm512_dpbusd_epi32(d, hi, hi_x[t]);
        acc[i][t] = _mm512_fmadd_ps(s, _mm512_mul_ps(_mm512_cvtepi32_ps(d), x_scale[t]), acc[i][t]);
      }
    }
  };
  int64_t b = 0;
  for (; b + B <= blocks; b += B) {
    for (int64_t o = 0; o < kRows * 64; o += 64) __builtin_prefetch(w.next + b / B * kRows * 64 + o);
    step(b, std::false_type{});
  }
  if constexpr (F == Fmt::I4) {
    if (blocks - b >= 2) {  // a whole pair: record_pos lays its columns out as pairs
      step(b, std::true_type{});
      b += 2;
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < nr; ++i) {
      float sum = _mm512_reduce_add_ps(acc[i][t]);
      for (int64_t k = b; k < blocks; ++k)
        sum += w.scales[i][k / per_group] * w.x[t].scale[k] * float(block_dot<F>(w.rows[i], k, w.x[t], m.K));
      res[t * kRows + i] = sum;
    }
}

// int8 / int4 from lane_start tokens on: sixteen rows as the sixteen int32 lanes. The loop above converts and
// scales each row's sums for every token, three vector operations beside every one (int8) or two (int4) vpdpbusd.
// Here a panel of 16 rows is laid out once so that vector v of block b holds 4 unsigned bytes of each row (int8:
// q + 128; int4: one nibble, q + 8), in order against the block's activation bytes 4v to 4v + 3: one vpdpbusd with
// those 4 bytes broadcast adds each row's 4 products to its own lane, the block's 8 vectors sum it exactly in int32
// (started at -offset x the block's activation sum, which takes the stored offset off), and the conversion and
// scaling cost one vector per 16 rows, token and block. The layout is paid once per panel, for all of a call's tokens.
constexpr int kLaneRows = 16, kLaneTok = 8;
// The lanes' start until measured (lane_start): on the Zen 5 box, at 4 tokens the layout cost about what it saved
// (int8), more (int4).
constexpr int64_t kLaneMinTokens = 8;
constexpr int64_t kLanePanelBytes = 128 << 10;

// AVX512-BF16 intrinsics need GCC 10 or clang 9; older compilers build the kernel without the bf16 lanes (the
// per-row loop takes bf16 rows, SDPA the prompt's attention).
#if defined(__clang__) ? __clang_major__ >= 9 : defined(__GNUC__) && __GNUC__ >= 10
#define HMOE_BF16 1
#endif

// Whether the CPU has AVX512-BF16 and this build its intrinsics (bf16_lane_rows).
inline bool bf16_lanes() {
#ifdef HMOE_BF16
  static const bool ok = __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// Whether m's rows take the lane route: whole 64-byte chunks of every row, int8 / int4, or bf16 times bf16 values
// (x_bf16) where the CPU has AVX512-BF16.
inline bool lanes_fit(const Matrix& m, bool x_bf16) {
  return m.row_bytes % 64 == 0 &&
         (m.fmt == Fmt::I8 || m.fmt == Fmt::I4 || (m.fmt == Fmt::BF16 && x_bf16 && bf16_lanes()));
}

// v[c] comes out as 4-byte element c of every input vector (input i in lane i): a 16 x 16 transposition.
inline void transpose16(__m512i (&v)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
  }
  // per 128-bit lane L, u[g + k] (g = 0, 4, 8, 12) holds element 4L + k of inputs g to g + 3
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather lane L of u[k], u[4 + k], u[8 + k], u[12 + k] into v[4L + k]
    const __m512i e0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), e1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    const __m512i f0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88),
                  f1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    v[k] = _mm512_shuffle_i32x4(e0, f0, 0x88);
    v[8 + k] = _mm512_shuffle_i32x4(e0, f0, 0xDD);
    v[4 + k] = _mm512_shuffle_i32x4(e1, f1, 0x88);
    v[12 + k] = _mm512_shuffle_i32x4(e1, f1, 0xDD);
  }
}

// Rows [r, r + nr) of m (nr <= 16; a short group repeats its last row) into panel (K / 32 blocks x 8 vectors x 64
// bytes) and scales ([K / group][16]: the rows' group scales, one per lane). A row's 64-byte chunk j holds int8
// blocks 2j and 2j + 1 (element c: block 2j + c / 8, vector c % 8), or int4 blocks 4j to 4j + 3 (element c: block
// 4j + c / 4, its even columns in the low nibbles as vector c % 4, its odd ones in the high nibbles as 4 + c % 4).
template <Fmt F>
void lane_panel(const Matrix& m, int64_t r, int nr, uint8_t* panel, float* scales) {
  const uint8_t* rows[kLaneRows];
  for (int i = 0; i < kLaneRows; ++i) rows[i] = m.row(r + std::min(i, nr - 1));
  const __m512i sign = _mm512_set1_epi8(char(0x80)), nibble = _mm512_set1_epi8(15);
  for (int64_t j = 0; j < m.row_bytes / 64; ++j) {
    __m512i v[16];
    for (int i = 0; i < kLaneRows; ++i) v[i] = _mm512_loadu_si512(rows[i] + 64 * j);
    transpose16(v);
    __m512i* out = reinterpret_cast<__m512i*>(panel) + (F == Fmt::I8 ? 16 : 32) * j;  // 8 vectors a block
    for (int c = 0; c < 16; ++c)
      if constexpr (F == Fmt::I8) {
        _mm512_storeu_si512(out + c, _mm512_xor_si512(v[c], sign));
      } else {
        _mm512_storeu_si512(out + 8 * (c / 4) + c % 4, _mm512_and_si512(v[c], nibble));
        _mm512_storeu_si512(out + 8 * (c / 4) + 4 + c % 4, _mm512_and_si512(_mm512_srli_epi16(v[c], 4), nibble));
      }
  }
  for (int64_t g = 0; g < m.K / m.group; ++g)
    for (int i = 0; i < kLaneRows; ++i) scales[g * kLaneRows + i] = m.scale_at(r + std::min(i, nr - 1), g);
}

// What the lanes read of a token: its activation bytes with block b at [32b, 32b + 32) in the panel's order (int8:
// the record's; int4: the record's pair of blocks regrouped, block by block), the block scales, and the int32 start
// of each block's sum (-offset x the sum of its activation bytes).
struct LaneInput {
  const int8_t* q;
  const float* scale;
  const int32_t* start;
};

template <Fmt F>
void lane_inputs(const void* const* xs, int64_t n, int64_t K, std::vector<int8_t>& bytes, std::vector<int32_t>& starts,
                 std::vector<LaneInput>& out) {
  const int64_t blocks = K / 32;
  constexpr int32_t offset = F == Fmt::I8 ? 128 : 8;
  if constexpr (F == Fmt::I4) bytes.resize(n * K);
  starts.resize(n * blocks);
  out.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const QuantRecord x(xs[t], K);
    const int8_t* q = x.q;
    if constexpr (F == Fmt::I4) {  // a pair's record: even columns of both blocks, then odd columns of both
      int8_t* p = bytes.data() + t * K;
      for (int64_t c = 0; c < K; c += 64) {
        std::memcpy(p + c, x.q + c, 16);
        std::memcpy(p + c + 16, x.q + c + 32, 16);
        std::memcpy(p + c + 32, x.q + c + 16, 16);
        std::memcpy(p + c + 48, x.q + c + 48, 16);
      }
      q = p;
    }
    int32_t* st = starts.data() + t * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t total = 0;
      for (int64_t c = 32 * b; c < 32 * b + 32; ++c) total += q[c];
      st[b] = -offset * total;
    }
    out[t] = {q, x.scale, st};
  }
}

// res[t * 16 + i] = row i of the panel . token t for t < NT.
template <int NT>
void lane_rows(const uint8_t* panel, const float* scales, int64_t K, int64_t group, const LaneInput* x, Prefetch next,
               float* res) {
  const int64_t per_group = group / 32;
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512i* w = reinterpret_cast<const __m512i*>(panel) + 8 * b;
    __m512i sum[NT];
    for (int t = 0; t < NT; ++t) sum[t] = _mm512_set1_epi32(x[t].start[b]);
    for (int v = 0; v < 8; ++v) {
      if (8 * b + v < next.lines) __builtin_prefetch(next.at + 64 * (8 * b + v));
      const __m512i wv = _mm512_loadu_si512(w + v);
      for (int t = 0; t < NT; ++t) {
        int32_t four;
        std::memcpy(&four, x[t].q + 32 * b + 4 * v, 4);
        sum[t] = _mm512_dpbusd_epi32(sum[t], wv, _mm512_set1_epi32(four));
      }
    }
    const __m512 s = _mm512_loadu_ps(scales + b / per_group * kLaneRows);
    for (int t = 0; t < NT; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), _mm512_mul_ps(s, _mm512_set1_ps(x[t].scale[b])), acc[t]);
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(res + t * kLaneRows, acc[t]);
}

// res[16 p + i] = row i of panel p . x for p < NP: one token over int8 panels lane_panel laid out, panel_bytes and
// panel_scales apart, each panel its own chain of vpdpbusd (lane_rows<1>'s one chain waits on every product), the same
// arithmetic as lane_rows.
template <int NP>
void lane_panels(const uint8_t* panel, int64_t panel_bytes, const float* scales, int64_t panel_scales, int64_t K,
                 int64_t group, const LaneInput& x, float* res) {
  const int64_t per_group = group / 32;
  __m512 acc[NP];
  for (int p = 0; p < NP; ++p) acc[p] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512i sum[NP];
    for (int p = 0; p < NP; ++p) sum[p] = _mm512_set1_epi32(x.start[b]);
    for (int v = 0; v < 8; ++v) {
      int32_t four;
      std::memcpy(&four, x.q + 32 * b + 4 * v, 4);
      const __m512i xv = _mm512_set1_epi32(four);
      for (int p = 0; p < NP; ++p) {
        const uint8_t* w = panel + p * panel_bytes + 64 * (8 * b + v);
        __builtin_prefetch(w + NP * panel_bytes);  // the next panels' line (contiguous: the op's next head's too)
        sum[p] = _mm512_dpbusd_epi32(sum[p], _mm512_loadu_si512(w), xv);
      }
    }
    const __m512 xs = _mm512_set1_ps(x.scale[b]);
    for (int p = 0; p < NP; ++p) {
      const __m512 s = _mm512_loadu_ps(scales + p * panel_scales + b / per_group * kLaneRows);
      acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[p]), _mm512_mul_ps(s, xs), acc[p]);
    }
  }
  for (int p = 0; p < NP; ++p) _mm512_storeu_ps(res + p * kLaneRows, acc[p]);
}

// res[16 t + i] = row i of a laid-out int4 panel . x[t] for t < NT (Matrix::laid: a panel holds 16 rows as K / 8
// vectors, vector 4b + v holding bytes 16b + 4v to 16b + 4v + 3 of each row, row i in lane i; its scales [K /
// group][16] fp16). A vector's low nibbles multiply block b's activation bytes 4v to 4v + 3, its high nibbles bytes 16
// + 4v on (lane_inputs' order), so each 64 bytes of weights cost two vpdpbusd on the stored bytes, and the conversion
// and scaling come once per block for 16 rows, where rows_dot_q pays them per row: 0.58-0.74x its time at one token
// with a projection's weights in cache (2 threads; benchmarks/RESULTS.md, 2026-12-02). Four sums a block, one per
// vector: one chain would wait on each product (of one token). One panel at a time, so a run's bytes are read as one
// stream. How far ahead of its reads the loop prefetches: from DRAM, 2 KB ran level with the row loop or up to 1.2x
// faster, 1 KB up to 1.2x slower, and four panels at a time (each read's line in the next four prefetched) 1.2x slower.
constexpr int64_t kLaidAhead = 2048;

template <int NT>
void laid_i4_rows(const uint8_t* panel, const uint16_t* scales, int64_t K, int64_t group, const LaneInput* x,
                  float* res) {
  const int64_t per_group = group / 32;
  const __m512i nibble = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512i sum[NT][4];
    for (int v = 0; v < 4; ++v) {
      const uint8_t* w = panel + 64 * (4 * b + v);
      __builtin_prefetch(w + kLaidAhead);
      const __m512i wv = _mm512_loadu_si512(w);
      const __m512i lo = _mm512_and_si512(wv, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), nibble);
      for (int t = 0; t < NT; ++t) {
        int32_t lo4, hi4;
        std::memcpy(&lo4, x[t].q + 32 * b + 4 * v, 4);
        std::memcpy(&hi4, x[t].q + 32 * b + 16 + 4 * v, 4);
        sum[t][v] = _mm512_dpbusd_epi32(v ? zero : _mm512_set1_epi32(x[t].start[b]), lo, _mm512_set1_epi32(lo4));
        sum[t][v] = _mm512_dpbusd_epi32(sum[t][v], hi, _mm512_set1_epi32(hi4));
      }
    }
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + b / per_group * 16)));
    for (int t = 0; t < NT; ++t) {
      const __m512i total =
          _mm512_add_epi32(_mm512_add_epi32(sum[t][0], sum[t][1]), _mm512_add_epi32(sum[t][2], sum[t][3]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(s, _mm512_set1_ps(x[t].scale[b])), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(res + 16 * t, acc[t]);
}

// matvec_block's laid-out int4 rows [r0, r1) (multiples of 16): panel after panel, up to four tokens a pass over each
// panel (each vector unpacked once for them), the panel in cache for the next pass.
inline void laid_i4_block(const Matrix& m, int64_t r0, int64_t r1, const void* const* xs, int64_t n, float* dst,
                          int64_t ld) {
  thread_local std::vector<int8_t> bytes;
  thread_local std::vector<int32_t> starts;
  thread_local std::vector<LaneInput> in;
  lane_inputs<Fmt::I4>(xs, n, m.K, bytes, starts, in);
  const int64_t panel_bytes = 8 * m.K, panel_scales = m.K / m.group * 16;
  float res[4 * 16];
  for (int64_t p = r0 / 16; p < r1 / 16; ++p) {
    const uint8_t* panel = m.data + p * panel_bytes;
    const uint16_t* scales = m.scale + p * panel_scales;
    for (int64_t t = 0; t < n; t += 4) {
      const int nt = int(std::min<int64_t>(4, n - t));
      switch (nt) {
        case 1:
          laid_i4_rows<1>(panel, scales, m.K, m.group, in.data() + t, res);
          break;
        case 2:
          laid_i4_rows<2>(panel, scales, m.K, m.group, in.data() + t, res);
          break;
        case 3:
          laid_i4_rows<3>(panel, scales, m.K, m.group, in.data() + t, res);
          break;
        default:
          laid_i4_rows<4>(panel, scales, m.K, m.group, in.data() + t, res);
      }
      for (int j = 0; j < nt; ++j) std::memcpy(dst + (t + j) * ld + 16 * p - r0, res + 16 * j, 16 * sizeof(float));
    }
  }
}

// Rows [0, N) of int8 m (N a multiple of 16) laid out for the lanes once, 16 rows a panel: panels (N / 16 x K / 4 x 64
// bytes) and scales (N / 16 x K / group x 16), as `laid_out_matvec` reads them.
inline void lay_out_panels(const Matrix& m, int64_t N, uint8_t* panels, float* scales) {
  for (int64_t p = 0; p < N / kLaneRows; ++p)
    lane_panel<Fmt::I8>(m, p * kLaneRows, kLaneRows, panels + p * 16 * m.K, scales + p * (m.K / m.group) * kLaneRows);
}

// res[r] = row r . x for r < 16 np: one token x (a QuantRecord of K int8 columns) times np panels `lay_out_panels`
// laid out. Four panels at a time: a row of 128 columns read row by row costs ~7 ns besides its products (its
// horizontal sum, the micro-kernel's set-up per 4 rows), 3-4 times its products (benchmarks/RESULTS.md, 2026-12-02).
inline void laid_out_matvec(const uint8_t* panels, const float* scales, int64_t np, int64_t K, int64_t group,
                            const void* x, float* res) {
  thread_local std::vector<int8_t> bytes;
  thread_local std::vector<int32_t> starts;
  thread_local std::vector<LaneInput> in;
  lane_inputs<Fmt::I8>(&x, 1, K, bytes, starts, in);
  const int64_t pb = 16 * K, ps = K / group * kLaneRows;
  int64_t p = 0;
  for (; p + 4 <= np; p += 4) lane_panels<4>(panels + p * pb, pb, scales + p * ps, ps, K, group, in[0], res + p * 16);
  for (; p < np; ++p) lane_panels<1>(panels + p * pb, pb, scales + p * ps, ps, K, group, in[0], res + p * 16);
}

// bf16 rows times bf16 values (a bf16 model's activations) from lane_start tokens on, on CPUs with
// AVX512-BF16: 32 rows as two vectors of 16 fp32 lanes. The per-row loop widens each weight to fp32 (a shift or a
// mask) and takes one FMA per 16 products; vdpbf16ps takes 16 column pairs of bf16 and adds both products of a pair
// to its lane, 32 products an instruction (it counts subnormal inputs as zero, so a subnormal weight or activation
// counts at 8 tokens and not at 7). 16 rows are laid out once so that
// vector p holds column pair p of each row; one vdpbf16ps against a token's pair p broadcast adds it to all 16 rows.
// Two such halves a call keep two independent sums a token: with one, a standalone test of the loop ran at 165 against
// 250 GMAC/s a thread, where oneDNN's bf16 GEMM ran at 200 (48 tokens, 2,816 x 2,048 in cache; benchmarks/RESULTS.md,
// 2026-11-28 afternoon).
constexpr int kBf16LaneRows = 2 * kLaneRows;
#ifdef HMOE_BF16
#define HMOE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,fma,f16c")))
#else
#define HMOE_BF16_TARGET
#endif

// The first `bytes` (a multiple of 64) of 16 bf16 rows as vectors of column pairs: out[p] holds pair p (columns 2p,
// 2p + 1) of each row, row i in lane i.
inline void bf16_pair_vectors(const uint8_t* const* rows, int64_t bytes, __m512i* out) {
  for (int64_t j = 0; j < bytes / 64; ++j) {
    __m512i v[16];
    for (int i = 0; i < kLaneRows; ++i) v[i] = _mm512_loadu_si512(rows[i] + 64 * j);
    transpose16(v);
    for (int c = 0; c < 16; ++c) _mm512_storeu_si512(out + 16 * j + c, v[c]);
  }
}

// Rows [r, r + nr) of bf16 m (nr <= 32; a short group repeats its last row) into panel: two halves of 16 rows, each
// K / 2 vectors, vector p the column pair (2p, 2p + 1) of each of its rows.
inline void bf16_lane_panel(const Matrix& m, int64_t r, int nr, uint8_t* panel) {
  for (int half = 0; half < 2; ++half) {
    const uint8_t* rows[kLaneRows];
    for (int i = 0; i < kLaneRows; ++i) rows[i] = m.row(r + std::min(kLaneRows * half + i, nr - 1));
    bf16_pair_vectors(rows, m.row_bytes, reinterpret_cast<__m512i*>(panel) + half * m.K / 2);
  }
}

// Each token's row of bf16 values held as fp32 (in the pairs layout: per 32 columns the even ones, then the odd ones)
// as K / 2 bf16 pairs, column 2p in the low half of pair p: the upper halves of the fp32 values.
inline void bf16_lane_inputs(const void* const* xs, int64_t n, int64_t K, std::vector<uint32_t>& pairs,
                             std::vector<const uint32_t*>& out) {
  pairs.resize(n * K / 2);
  out.resize(n);
  const __m512i high = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t t = 0; t < n; ++t) {
    const float* x = static_cast<const float*>(xs[t]);
    uint32_t* p = pairs.data() + t * K / 2;
    for (int64_t c = 0; c < K; c += 32)
      _mm512_storeu_si512(p + c / 2, _mm512_or_si512(_mm512_srli_epi32(_mm512_loadu_si512(x + c), 16),
                                                     _mm512_and_si512(_mm512_loadu_si512(x + c + 16), high)));
    out[t] = p;
  }
}

// res[t * 32 + i] = row i of the panel . token t for t < NT. (Without the intrinsics never called: bf16_lanes().)
template <int NT>
HMOE_BF16_TARGET void bf16_lane_rows(const uint8_t* panel, int64_t K, const uint32_t* const* x, Prefetch next,
                                     float* res) {
#ifdef HMOE_BF16
  const __m512i* w = reinterpret_cast<const __m512i*>(panel);
  __m512 acc[2][NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    for (int64_t l = p; l < next.lines && l < p + K; l += K / 2) __builtin_prefetch(next.at + 64 * l);
    const __m512bh a = (__m512bh)_mm512_loadu_si512(w + p), b = (__m512bh)_mm512_loadu_si512(w + K / 2 + p);
    for (int t = 0; t < NT; ++t) {
      const __m512bh v = (__m512bh)_mm512_set1_epi32(int(x[t][p]));
      acc[0][t] = _mm512_dpbf16_ps(acc[0][t], a, v);
      acc[1][t] = _mm512_dpbf16_ps(acc[1][t], b, v);
    }
  }
  for (int t = 0; t < NT; ++t) {
    _mm512_storeu_ps(res + t * kBf16LaneRows, acc[0][t]);
    _mm512_storeu_ps(res + t * kBf16LaneRows + kLaneRows, acc[1][t]);
  }
#endif
}
#undef HMOE_BF16_TARGET
#elif HMOE_LEVEL == 1
// Block b (32 columns) of a row as 32 int8 lanes in the record's order: int8 as stored; int4 (its unpaired last
// block) as q + 8, the block's 16 bytes' low nibbles (even columns) then high nibbles (odd columns).
template <Fmt F>
inline __m256i load_block(const uint8_t* row, int64_t b) {
  if constexpr (F == Fmt::I8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * b));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * b));
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
  }
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// acc + (int16 pair sums, summed again in pairs to int32) * scale.
inline __m256 add_products(__m256i pairs, __m256 scale, __m256 acc) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1))), scale, acc);
}

template <int NT>
inline void zero(__m256 (&v)[kRows][NT]) {
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < NT; ++t) v[i][t] = _mm256_setzero_ps();
}

// int8: one block per step; maddubs multiplies unsigned by signed bytes, so w's sign moves onto x.
template <int NT>
void rows_dot_i8(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, float* res) {
  const QuantOperands<NT> w(m, r0, nr, next, xs);
  const int64_t per_group = m.group / 32;
  __m256 acc[kRows][NT], part[kRows][NT];
  zero(acc);
  for (int64_t b0 = 0; b0 < m.K / 32; b0 += per_group) {
    zero(part);
    for (int64_t b = b0; b < b0 + per_group; ++b) {
      for (int64_t o = 0; o < kRows * 32; o += 64) __builtin_prefetch(w.next + b * kRows * 32 + o);
      __m256i xq[NT];
      __m256 xs_b[NT];
      w.block(b, xq, xs_b);
      for (int i = 0; i < kRows; ++i) {
        const __m256i q = load_block<Fmt::I8>(w.rows[i], b), magnitude = _mm256_sign_epi8(q, q);
        for (int t = 0; t < NT; ++t)
          part[i][t] = add_products(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xq[t], q)), xs_b[t], part[i][t]);
      }
    }
    for (int i = 0; i < kRows; ++i) {
      const __m256 s = _mm256_set1_ps(w.scales[i][b0 / per_group]);
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm256_fmadd_ps(part[i][t], s, acc[i][t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < nr; ++i) res[t * kRows + i] = hsum8(acc[i][t]);
}

// int4: two blocks per step. 32 packed bytes give their low nibbles (the even columns of both blocks) and high
// nibbles (the odd columns); the products' int32 lanes 0-3 then belong to the first block and 4-7 to the second.
// The weights are stored as q + 8: the loop sums s_w * x_scale * (q + 8) . x and the 8 * s_w * sum(x) term comes off
// once per row and token at the end, from the activations' sums per weight group (I4Lanes). The activation scales
// come from I4Lanes too, already one per lane. So the loop holds only the accumulators, one row's weights and
// scale, and two constants: with the offset and the lane shuffles inside it, it spilled accumulators and ran at
// 22-31 GMAC/s a thread at many rows against 42 for the same arithmetic alone (benchmarks/RESULTS.md, 2026-11-27).
inline __m256 step_lanes(float first, float second) {  // lanes 0-3: first, lanes 4-7: second
  return _mm256_set_m128(_mm_set1_ps(second), _mm_set1_ps(first));
}

// Per token of xs, its I4Lanes for a K-column weight in groups of `group`, written to buf ((K / 8 + K / group) floats a
// token); an unpaired last block's scale is read from the record.
inline void i4_lanes(const void* const* xs, int64_t n, int64_t K, int64_t group, std::vector<float>& buf,
                     std::vector<I4Lanes>& lanes) {
  const int64_t steps = K / 64, groups = K / group, per_group = group / 32, each = 8 * steps + groups;
  buf.resize(n * each);
  lanes.resize(n);
  for (int64_t t = 0; t < n; ++t) {
    const QuantRecord x(xs[t], K);
    float* sc = buf.data() + t * each;
    float* gs = sc + 8 * steps;
    for (int64_t j = 0; j < steps; ++j) _mm256_storeu_ps(sc + 8 * j, step_lanes(x.scale[2 * j], x.scale[2 * j + 1]));
    for (int64_t g = 0; g < groups; ++g) {
      float total = 0.f;
      for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) total += x.sum[b];
      gs[g] = total;
    }
    lanes[t] = {sc, gs};
  }
}

// acc + s * x_scale * (int16 pair products summed in pairs): one step of one row and token.
inline __m256 add_step(__m256 s, __m256i pairs, __m256 x_scale, __m256 acc) {
  const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  return _mm256_fmadd_ps(_mm256_mul_ps(dot, x_scale), s, acc);
}

// How a step finds each row's weight scales: one group covers whole steps (one broadcast, the group counted, not
// divided for), a group per block (the step's two scales loaded together), or any other odd group (two lookups).
enum class StepScales { Whole, PerBlock, Other };

template <int NT, StepScales S>
void i4_steps(const QuantOperands<NT>& w, const I4Lanes* xl, int64_t steps, int64_t per_group,
              __m256 (&out)[kRows][NT]) {
  __m256 acc[kRows][NT];  // a local copy: with the caller's array in the loop, GCC stored every sum back each step
  zero(acc);
  const __m256i nibble = _mm256_set1_epi8(15);
  const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  int64_t group = 0, into = 0;  // Whole: step j's group, and j's place in it
  for (int64_t j = 0; j < steps; ++j) {
    for (int64_t o = 0; o < kRows * 32; o += 64) __builtin_prefetch(w.next + j * kRows * 32 + o);
    for (int i = 0; i < kRows; ++i) {
      __m256 s;
      if constexpr (S == StepScales::Whole)
        s = _mm256_broadcast_ss(w.scales[i] + group);
      else if constexpr (S == StepScales::PerBlock)
        s = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(w.scales[i] + 2 * j)))),
            pair);
      else
        s = step_lanes(w.scales[i][2 * j / per_group], w.scales[i][(2 * j + 1) / per_group]);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.rows[i] + 32 * j));
      const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
      for (int t = 0; t < NT; ++t) {  // q + 8 <= 15 and |x| <= 127: the two int16 products add without saturating
        const __m256i* x = reinterpret_cast<const __m256i*>(w.x[t].q + 64 * j);
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(x)),
                                               _mm256_maddubs_epi16(hi, _mm256_loadu_si256(x + 1)));
        acc[i][t] = add_step(s, pairs, _mm256_loadu_ps(xl[t].scale + 8 * j), acc[i][t]);
      }
    }
    if constexpr (S == StepScales::Whole)
      if (++into == per_group / 2) {
        into = 0;
        ++group;
      }
  }
  for (int i = 0; i < kRows; ++i)
    for (int t = 0; t < NT; ++t) out[i][t] = acc[i][t];
}

template <int NT>
void rows_dot_i4(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, const I4Lanes* xl,
                 float* res) {
  const QuantOperands<NT> w(m, r0, nr, next, xs);
  const int64_t blocks = m.K / 32, steps = blocks / 2, per_group = m.group / 32, groups = m.K / m.group;
  __m256 acc[kRows][NT];
  if (per_group % 2 == 0)
    i4_steps<NT, StepScales::Whole>(w, xl, steps, per_group, acc);
  else if (per_group == 1)
    i4_steps<NT, StepScales::PerBlock>(w, xl, steps, per_group, acc);
  else
    i4_steps<NT, StepScales::Other>(w, xl, steps, per_group, acc);
  if (2 * steps < blocks) {  // an odd block count leaves the last block unpaired: all 8 lanes are its own
    const int64_t b = 2 * steps;
    for (int t = 0; t < NT; ++t) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.x[t].q + 32 * b));
      const __m256 x_scale = _mm256_set1_ps(w.x[t].scale[b]);
      for (int i = 0; i < kRows; ++i)
        acc[i][t] = add_step(_mm256_set1_ps(w.scales[i][b / per_group]),
                             _mm256_maddubs_epi16(load_block<Fmt::I4>(w.rows[i], b), x), x_scale, acc[i][t]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int i = 0; i < nr; ++i) {
      __m256 offset = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8)
        offset = _mm256_fmadd_ps(_mm256_loadu_ps(w.scales[i] + g), _mm256_loadu_ps(xl[t].group_sum + g), offset);
      float tail = 0.f;
      for (; g < groups; ++g) tail += w.scales[i][g] * xl[t].group_sum[g];
      res[t * kRows + i] = hsum8(_mm256_fnmadd_ps(offset, _mm256_set1_ps(8.f), acc[i][t])) - 8.f * tail;
    }
}

// int4 from lane_start tokens on: eight rows as the eight int32 lanes. The loop above spends a conversion, a
// scale multiply and an add on every row and token for each 64 columns, with a row's sum spread over its lanes. Here
// a row group's bytes are first transposed into a panel (vector u of a step holds bytes [4u, 4u + 4) of each of the
// 8 rows), so that one vpmaddubsw on a vector and four activation bytes broadcast gives each row's own products in
// its own lane. A block's 8 products per row are summed exactly in int16 (at most 8 x 2 x 15 x 127 = 30,480), and the
// conversion and scaling then cost one vector per 8 rows, token and block: 81 against 53 GMAC/s a thread in a
// standalone test of the two loops (benchmarks/RESULTS.md, 2026-11-28). The transposition is paid once per
// panel, for all of a call's tokens; below lane_start it is not worth it.
constexpr int kLaneRows = 8, kLaneTok = 4;
constexpr int64_t kLaneMinTokens = 16;  // until measured (lane_start): at 4 and 8 tokens the transposition cost more
constexpr int64_t kLanePanelBytes = 128 << 10;  // 64 KB panels ran at two thirds of the rate in the standalone test

// Whether m's rows take the lane route: int4 in whole 64-column steps.
inline bool lanes_fit(const Matrix& m) { return m.fmt == Fmt::I4 && m.K % 64 == 0; }

// Rows [r, r + nr) of m (nr <= 8; a short group repeats its last row) into panel (K / 2 * 8 bytes: per step, 8
// vectors of 8 rows x 4 bytes) and scales ([K / group][8]: the rows' group scales, one per lane).
inline void i4_lane_panel(const Matrix& m, int64_t r, int nr, uint8_t* panel, float* scales) {
  const uint8_t* rows[kLaneRows];
  for (int i = 0; i < kLaneRows; ++i) rows[i] = m.row(r + std::min(i, nr - 1));
  for (int64_t j = 0; j < m.K / 64; ++j) {
    __m256i v[kLaneRows];
    for (int i = 0; i < kLaneRows; ++i) v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + 32 * j));
    // an 8 x 8 transposition of 4-byte elements: rows pairwise by 4, then by 8, then 128-bit halves
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
      a[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
      a[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
      for (int h = 0; h < 2; ++h) {
        b[i + 2 * h] = _mm256_unpacklo_epi64(a[i + h], a[i + h + 2]);
        b[i + 2 * h + 1] = _mm256_unpackhi_epi64(a[i + h], a[i + h + 2]);
      }
    __m256i* out = reinterpret_cast<__m256i*>(panel + 256 * j);
    for (int u = 0; u < 4; ++u) {
      _mm256_storeu_si256(out + u, _mm256_permute2x128_si256(b[u], b[u + 4], 0x20));
      _mm256_storeu_si256(out + u + 4, _mm256_permute2x128_si256(b[u], b[u + 4], 0x31));
    }
  }
  const int64_t groups = m.K / m.group;
  for (int64_t g = 0; g < groups; ++g)
    for (int i = 0; i < kLaneRows; ++i) scales[g * kLaneRows + i] = m.scale_at(r + std::min(i, nr - 1), g);
}

// res[t * 8 + i] = row i of the panel . xs[t] for t < NT: per block, the int16 sums of its four vectors' products
// (low nibbles with the record's first 32 bytes of the step, high nibbles with the next 32), one vpmaddwd to int32,
// times (the rows' scale x the block's activation scale); then the q + 8 offset off per weight group (I4Lanes).
template <int NT>
void i4_lane_rows(const uint8_t* panel, const float* scales, int64_t K, int64_t group, const void* const* xs,
                  const I4Lanes* xl, Prefetch next, float* res) {
  const __m256i nibble = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int64_t per_group = group / 32;
  QuantRecord x[NT];
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) {
    x[t] = QuantRecord(xs[t], K);
    acc[t] = _mm256_setzero_ps();
  }
  for (int64_t j = 0; j < K / 64; ++j) {
    const __m256i* w = reinterpret_cast<const __m256i*>(panel + 256 * j);
    for (int half = 0; half < 2; ++half) {  // block 2j: bytes 0-15 of each row's step; block 2j + 1: bytes 16-31
      const int64_t b = 2 * j + half;
      __m256i sum[NT];
      for (int t = 0; t < NT; ++t) sum[t] = _mm256_setzero_si256();
      for (int u = 4 * half; u < 4 * half + 4; ++u) {
        if (8 * j + u < next.lines) __builtin_prefetch(next.at + 64 * (8 * j + u));
        const __m256i v = _mm256_loadu_si256(w + u);
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        for (int t = 0; t < NT; ++t) {
          int32_t even, odd;
          std::memcpy(&even, x[t].q + 64 * j + 4 * u, 4);
          std::memcpy(&odd, x[t].q + 64 * j + 32 + 4 * u, 4);
          sum[t] = _mm256_add_epi16(sum[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(even)),
                                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(odd))));
        }
      }
      const __m256 s = _mm256_loadu_ps(scales + b / per_group * kLaneRows);
      for (int t = 0; t < NT; ++t)
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[t], ones)),
                                 _mm256_mul_ps(s, _mm256_broadcast_ss(x[t].scale + b)), acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m256 offset = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / group; ++g)
      offset =
          _mm256_fmadd_ps(_mm256_loadu_ps(scales + g * kLaneRows), _mm256_broadcast_ss(xl[t].group_sum + g), offset);
    _mm256_storeu_ps(res + t * kLaneRows, _mm256_fnmadd_ps(offset, _mm256_set1_ps(8.f), acc[t]));
  }
}

template <Fmt F, int NT>
void rows_dot_q(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, const I4Lanes* xl,
                float* res) {
  if constexpr (F == Fmt::I8)
    rows_dot_i8<NT>(m, r0, nr, next, xs, res);
  else
    rows_dot_i4<NT>(m, r0, nr, next, xs, xl, res);
}
#else
template <Fmt F, int NT>
void rows_dot_q(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, const I4Lanes*,
                float* res) {
  const int64_t per_group = m.group / 32;
  for (int t = 0; t < NT; ++t) {
    const QuantRecord x(xs[t], m.K);
    for (int i = 0; i < nr; ++i) {
      const uint8_t* row = m.row(r0 + i);
      const uint16_t* scales = m.row_scale(r0 + i);
      float acc = 0.f;
      for (int64_t b0 = 0; b0 < m.K / 32; b0 += per_group) {
        float part = 0.f;
        for (int64_t b = b0; b < b0 + per_group; ++b) part += float(block_dot<F>(row, b, x, m.K)) * x.scale[b];
        acc += part * half_to_float(scales[b0 / per_group]);
      }
      res[t * kRows + i] = acc;
    }
  }
}
#endif

#if HMOE_LEVEL >= 1
// f(std::integral_constant<int, nt>{}) for 1 <= nt <= kLaneTok.
template <int N = 1, typename Fn>
inline void lane_tokens(int nt, Fn f) {
  if constexpr (N == kLaneTok)
    f(std::integral_constant<int, N>{});
  else if (nt == N)
    f(std::integral_constant<int, N>{});
  else
    lane_tokens<N + 1>(nt, f);
}

// What one lane route lays out and reads: a group's panel bytes and scales, and a token's input bytes.
struct LaneSizes {
  int64_t group_bytes, group_scales, token_bytes;
};

// matvec_block's lane route: panels of rows laid out once, Rows at a time (build(r, nr, panel, scales)), then every
// chunk of tokens passes over them (dot(panel, scales, t, nt, res): res[j * Rows + i] for the nt <= kLaneTok tokens
// from t), as matvec_block tiles its own.
template <int Rows, typename Build, typename Dot>
void lane_block(const Matrix& m, int64_t r0, int64_t r1, int64_t n, LaneSizes z, float* dst, int64_t ld, Build build,
                Dot dot) {
  thread_local std::vector<uint8_t> panel;
  thread_local std::vector<float> scales;
  const int64_t rows = std::max<int64_t>(1, kLanePanelBytes / z.group_bytes) * Rows;
  const int64_t chunk = std::max<int64_t>(1, kTokenChunkBytes / z.token_bytes / kLaneTok) * kLaneTok;
  panel.resize(rows / Rows * z.group_bytes);
  scales.resize(rows / Rows * z.group_scales);
  float res[kLaneTok * Rows];
  for (int64_t p0 = r0; p0 < r1; p0 += rows) {
    const int64_t p1 = std::min(r1, p0 + rows);
    for (int64_t r = p0; r < p1; r += Rows)
      build(r, int(std::min<int64_t>(Rows, p1 - r)), panel.data() + (r - p0) / Rows * z.group_bytes,
            scales.data() + (r - p0) / Rows * z.group_scales);
    // the next panel's rows (contiguous, within this run), a share each call of the first chunk: laid out next,
    // they are in cache
    const int64_t calls = (p1 - p0 + Rows - 1) / Rows * ((std::min(n, chunk) + kLaneTok - 1) / kLaneTok);
    int64_t left = (std::min(r1, p1 + rows) - p1) * m.row_bytes / 64;
    const int64_t share = (left + calls - 1) / calls;
    const uint8_t* ahead = m.row(p1);
    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
      const int64_t t1 = std::min(n, t0 + chunk);
      for (int64_t r = p0; r < p1; r += Rows) {
        const uint8_t* pw = panel.data() + (r - p0) / Rows * z.group_bytes;
        const float* ps = scales.data() + (r - p0) / Rows * z.group_scales;
        const int nr = int(std::min<int64_t>(Rows, p1 - r));
        for (int64_t t = t0; t < t1; t += kLaneTok) {
          const int nt = int(std::min<int64_t>(kLaneTok, t1 - t));
          const Prefetch next{ahead, std::min(share, left)};
          dot(pw, ps, t, nt, next, res);
          ahead += 64 * next.lines;
          left -= next.lines;
          for (int j = 0; j < nt; ++j)
            for (int i = 0; i < nr; ++i) dst[(t + j) * ld + (r - r0) + i] = res[j * Rows + i];
        }
      }
    }
  }
}
#endif

#if HMOE_LEVEL == 2
// matvec_block's int8 / int4 / bf16 rows from lane_start tokens on (lanes_fit).
template <Fmt F>
void lane_route(const Matrix& m, int64_t r0, int64_t r1, const void* const* xs, int64_t n, float* dst, int64_t ld) {
  if constexpr (F == Fmt::BF16) {
    thread_local std::vector<uint32_t> pairs;
    thread_local std::vector<const uint32_t*> in;
    bf16_lane_inputs(xs, n, m.K, pairs, in);
    lane_block<kBf16LaneRows>(
        m, r0, r1, n, {kBf16LaneRows * m.row_bytes, 0, 2 * m.K}, dst, ld,
        [&](int64_t r, int nr, uint8_t* panel, float*) { bf16_lane_panel(m, r, nr, panel); },
        [&](const uint8_t* panel, const float*, int64_t t, int nt, Prefetch next, float* res) {
          lane_tokens(nt, [&](auto k) { bf16_lane_rows<decltype(k)::value>(panel, m.K, in.data() + t, next, res); });
        });
  } else {
    thread_local std::vector<int8_t> bytes;
    thread_local std::vector<int32_t> starts;
    thread_local std::vector<LaneInput> in;
    lane_inputs<F>(xs, n, m.K, bytes, starts, in);
    lane_block<kLaneRows>(
        m, r0, r1, n, {m.K / 32 * 8 * 64, m.K / m.group * kLaneRows, record_bytes(m.K)}, dst, ld,
        [&](int64_t r, int nr, uint8_t* panel, float* scales) { lane_panel<F>(m, r, nr, panel, scales); },
        [&](const uint8_t* panel, const float* scales, int64_t t, int nt, Prefetch next, float* res) {
          lane_tokens(nt, [&](auto k) {
            lane_rows<decltype(k)::value>(panel, scales, m.K, m.group, in.data() + t, next, res);
          });
        });
  }
}
#elif HMOE_LEVEL == 1
// matvec_block's int4 rows from lane_start tokens on (lanes_fit).
void lane_route(const Matrix& m, int64_t r0, int64_t r1, const void* const* xs, const I4Lanes* xl, int64_t n,
                float* dst, int64_t ld) {
  lane_block<kLaneRows>(
      m, r0, r1, n, {m.K / 2 * kLaneRows, m.K / m.group * kLaneRows, record_bytes(m.K)}, dst, ld,
      [&](int64_t r, int nr, uint8_t* panel, float* scales) { i4_lane_panel(m, r, nr, panel, scales); },
      [&](const uint8_t* panel, const float* scales, int64_t t, int nt, Prefetch next, float* res) {
        lane_tokens(nt, [&](auto k) {
          i4_lane_rows<decltype(k)::value>(panel, scales, m.K, m.group, xs + t, xl + t, next, res);
        });
      });
}
#endif

template <Fmt F, int NT>
void rows_any(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, const I4Lanes* xl,
              float* res) {
  if constexpr (F == Fmt::I8 || F == Fmt::I4)
    rows_dot_q<F, NT>(m, r0, nr, next, xs, xl, res);
  else
    rows_dot<F, NT>(m, r0, nr, next, xs, res);
}

template <Fmt F>
void rows_dispatch(const Matrix& m, int64_t r0, int nr, const uint8_t* next, const void* const* xs, const I4Lanes* xl,
                   int nt, float* res) {
  switch (nt) {
    case 1:
      return rows_any<F, 1>(m, r0, nr, next, xs, xl, res);
    case 2:
      return rows_any<F, 2>(m, r0, nr, next, xs, xl, res);
    case 3:
      if constexpr (kTok >= 3) return rows_any<F, 3>(m, r0, nr, next, xs, xl, res);
      break;
    case 4:
      if constexpr (kTok >= 4) return rows_any<F, 4>(m, r0, nr, next, xs, xl, res);
      break;
  }
}

// dst[t * ld + (r - r0)] = row r of m . xs[t] for rows [r0, r1) and tokens [0, n); xs are fp32 rows in the
// layout (float formats; `x_bf16`: holding bf16 values, which bf16 rows may multiply as bf16) or QuantRecords (int8 /
// int4). Rows are read as one run: while the first chunk streams a panel, each call prefetches the next call's rows,
// none of another thread's run (its bytes would be read twice).
void matvec_block(const Matrix& m, int64_t r0, int64_t r1, const void* const* xs, int64_t n,
                  [[maybe_unused]] bool x_bf16, float* dst, int64_t ld) {
  float res[kTok * kRows];
  const I4Lanes* xl = nullptr;
#if HMOE_LEVEL == 2
  if (m.laid) return laid_i4_block(m, r0, r1, xs, n, dst, ld);
#else
  TORCH_CHECK(!m.laid, "laid-out int4 rows need the AVX-512 VNNI kernels");
#endif
#if HMOE_LEVEL == 1
  thread_local std::vector<float> lane_values;
  thread_local std::vector<I4Lanes> lanes;
  if (m.fmt == Fmt::I4) {
    i4_lanes(xs, n, m.K, m.group, lane_values, lanes);
    xl = lanes.data();
    if (n >= lane_start(HMOE_LEVEL, m.fmt) && lanes_fit(m)) return lane_route(m, r0, r1, xs, xl, n, dst, ld);
  }
#elif HMOE_LEVEL == 2
  if (n >= lane_start(HMOE_LEVEL, m.fmt) && lanes_fit(m, x_bf16))
    return (m.fmt == Fmt::I8   ? lane_route<Fmt::I8>
            : m.fmt == Fmt::I4 ? lane_route<Fmt::I4>
                               : lane_route<Fmt::BF16>)(m, r0, r1, xs, n, dst, ld);
#endif
  decltype(&rows_dispatch<Fmt::F32>) dispatch = nullptr;
  switch (m.fmt) {
    case Fmt::F32:
      dispatch = rows_dispatch<Fmt::F32>;
      break;
    case Fmt::BF16:
      dispatch = rows_dispatch<Fmt::BF16>;
      break;
    case Fmt::F16:
      dispatch = rows_dispatch<Fmt::F16>;
      break;
    case Fmt::I8:
      dispatch = rows_dispatch<Fmt::I8>;
      break;
    case Fmt::I4:
      dispatch = rows_dispatch<Fmt::I4>;
      break;
  }
  const int64_t panel = std::max<int64_t>(1, kPanelBytes / (m.row_bytes * kRows)) * kRows;
  const int64_t chunk =
      std::max<int64_t>(1, kTokenChunkBytes / (4 * m.K * kTok)) * kTok;  // fp32 rows: the largest input
  for (int64_t p0 = r0; p0 < r1; p0 += panel) {
    const int64_t p1 = std::min(r1, p0 + panel);
    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
      const int64_t t1 = std::min(n, t0 + chunk);
      for (int64_t r = p0; r < p1; r += kRows) {
        const int nr = int(std::min<int64_t>(kRows, p1 - r));
        // the next rows while streaming; at the run's end, or once the panel is in cache, rows already there
        const uint8_t* next = m.row(t0 == 0 && r + kRows < r1 ? r + kRows : r);
        for (int64_t t = t0; t < t1; t += kTok) {
          const int nt = int(std::min<int64_t>(kTok, t1 - t));
          dispatch(m, r, nr, next, xs + t, xl ? xl + t : nullptr, nt, res);
          for (int j = 0; j < nt; ++j)
            for (int i = 0; i < nr; ++i) dst[(t + j) * ld + (r - r0) + i] = res[j * kRows + i];
        }
      }
    }
  }
}

// Rows [r0, r1) of m as fp32 into dst (row-major), columns in the same order as the micro-kernels read
// them (pairs_layout): the weight panel a GEMM multiplies by equally laid-out activations.
template <Fmt F>
void dequant_rows_as(const Matrix& m, int64_t r0, int64_t r1, float* dst) {
  const int64_t full = m.K / kStep * kStep;
  const int64_t group = m.scale ? m.group : std::max<int64_t>(full, 1);
  thread_local std::vector<uint8_t> gathered;
  thread_local std::vector<uint16_t> gathered_scales;
  if (m.laid) {
    gathered.resize(m.row_bytes);
    gathered_scales.resize(m.K / m.group);
  }
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = m.laid ? m.gather_row(r, gathered.data()) : m.row(r);
    const uint16_t* scales = m.laid ? m.gather_scales(r, gathered_scales.data()) : m.row_scale(r);
    float* out = dst + (r - r0) * m.K;
    for (int64_t g0 = 0; g0 < full; g0 += group) {
      const float s = scales ? half_to_float(scales[g0 / group]) : 1.f;
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
    case Fmt::F32:
      return dequant_rows_as<Fmt::F32>(m, r0, r1, dst);
    case Fmt::BF16:
      return dequant_rows_as<Fmt::BF16>(m, r0, r1, dst);
    case Fmt::F16:
      return dequant_rows_as<Fmt::F16>(m, r0, r1, dst);
    case Fmt::I8:
      return dequant_rows_as<Fmt::I8>(m, r0, r1, dst);
    case Fmt::I4:
      return dequant_rows_as<Fmt::I4>(m, r0, r1, dst);
  }
}

// Rows [r0, r1) dequantised as dequant_rows does, then rounded to bf16 (nearest even; the weights are finite) a
// vector at a time: the bf16 GEMM route's panels, with the fp32 row only in L1.
void dequant_rows_bf16(const Matrix& m, int64_t r0, int64_t r1, uint16_t* dst) {
  typedef uint16_t vh __attribute__((vector_size(HMOE_VBYTES / 2)));
  std::vector<float> row(m.K);
  for (int64_t r = r0; r < r1; ++r) {
    dequant_rows(m, r, r + 1, row.data());
    uint16_t* out = dst + (r - r0) * m.K;
    int64_t k = 0;
    for (; k + W <= m.K; k += W) {
      vu b = load<vu>(row.data() + k);
      b += 0x7FFFu + ((b >> 16) & 1u);
      const vh h = __builtin_convertvector(b >> 16, vh);
      std::memcpy(out + k, &h, sizeof(vh));
    }
    for (; k < m.K; ++k) {
      uint32_t b;
      std::memcpy(&b, row.data() + k, 4);
      out[k] = uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
  }
}

// Activation row x (K fp32, natural column order) made ready for int8 / int4 weights: its QuantRecord at rec
// (quantise_row) and, where the GEMM route reads it too (gemm not null; may be x itself), its quantised values in
// this level's layout at gemm. The AVX-512 and AVX2 levels quantise a 32-column block per step with the same
// operations as quantise_row (max |x|, one division, products rounded to nearest even), so a finite row's record is
// the same bytes, and the GEMM values are the stored int8 times the scale: on a 512-token prefill the scalar form
// took a tenth of an int8 layer (benchmarks/RESULTS.md, 2026-11-26 night), and an AVX2 call on 16 int4 rows of 2048
// columns took 19.5 us with it against 13.2 in vector code (2026-11-28).
void quantise_rows(const float* x, int64_t K, Fmt f, uint8_t* rec, float* gemm) {
#if HMOE_LEVEL == 2
  static_assert(kStep == 32, "a step is one quantisation block");
  int8_t* q = reinterpret_cast<int8_t*>(rec);
  float* scale = reinterpret_cast<float*>(rec + K);
  float* sum = scale + K / 32;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float s = amax / 127.f, inv = inverse_scale(s);
    const __m512 vinv = _mm512_set1_ps(inv);
    __m512i v0 = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vinv)), v1 = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vinv));
    scale[b] = s;
    sum[b] = s * float(_mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1)));
    if (f == Fmt::I4) {  // the record's and the layout's order: the block's even columns, then its odd ones
      const __m512i e = _mm512_permutex2var_epi32(v0, even, v1), o = _mm512_permutex2var_epi32(v0, odd, v1);
      v0 = e;
      v1 = o;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + record_pos(32 * b, K, f)), _mm512_cvtepi32_epi8(v0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + record_pos(32 * b + (f == Fmt::I4 ? 1 : 16), K, f)),
                     _mm512_cvtepi32_epi8(v1));
    if (gemm) {  // from the int8 values as stored, as the scalar form reads them back
      const __m512 vs = _mm512_set1_ps(s);
      const __m512i q0 = _mm512_cvtepi8_epi32(_mm512_cvtepi32_epi8(v0)),
                    q1 = _mm512_cvtepi8_epi32(_mm512_cvtepi32_epi8(v1));
      _mm512_storeu_ps(gemm + 32 * b, _mm512_mul_ps(_mm512_cvtepi32_ps(q0), vs));
      _mm512_storeu_ps(gemm + 32 * b + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(q1), vs));
    }
  }
#elif HMOE_LEVEL == 1
  static_assert(kStep == 16, "a quantisation block is two steps");
  int8_t* q = reinterpret_cast<int8_t*>(rec);
  float* scale = reinterpret_cast<float*>(rec + K);
  float* sum = scale + K / 32;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i natural = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes packs' interleaving of 128-bit lanes
  const __m256i evens_first = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  // each 128-bit lane's 16 bytes as its 8 even-column bytes, then its 8 odd ones
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12,
                                         14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
    const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                   _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float s = amax / 127.f, inv = inverse_scale(s);
    const __m256 vinv = _mm256_set1_ps(inv);
    __m256i n[4];  // rounded to nearest even, as std::nearbyint in the default rounding mode
    for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vinv));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
    scale[b] = s;
    sum[b] = s * float(_mm_cvtsi128_si32(t4));
    // |n| <= 127: the saturating packs keep every value; the 32 bytes come out in column order
    __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])), natural);
    if (f == Fmt::I4)  // the record's order: the block's even columns, then its odd ones
      bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + record_pos(32 * b, K, f)), _mm256_castsi256_si128(bytes));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + record_pos(32 * b + (f == Fmt::I4 ? 1 : 16), K, f)),
                     _mm256_extracti128_si256(bytes, 1));
    if (gemm) {  // q * s in this level's layout: int4 pairs each step's even columns, then its odd ones
      const __m256 vs = _mm256_set1_ps(s);
      for (int j = 0; j < 4; j += 2) {
        __m256i lo = n[j], hi = n[j + 1];
        if (f == Fmt::I4) {
          const __m256i a = _mm256_permutevar8x32_epi32(lo, evens_first),
                        c = _mm256_permutevar8x32_epi32(hi, evens_first);
          lo = _mm256_permute2x128_si256(a, c, 0x20);
          hi = _mm256_permute2x128_si256(a, c, 0x31);
        }
        _mm256_storeu_ps(gemm + 32 * b + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(lo), vs));
        _mm256_storeu_ps(gemm + 32 * b + 8 * j + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(hi), vs));
      }
    }
  }
#else
  quantise_row(x, K, f, rec);
  if (!gemm) return;
  const QuantRecord r(rec, K);
  thread_local std::vector<float> natural;
  natural.resize(K);
  for (int64_t c = 0; c < K; ++c) natural[c] = float(r.q[record_pos(c, K, f)]) * r.scale[c / 32];
  for (int64_t c = 0; c < K; ++c) gemm[layout_pos(c, K, f, kStep)] = natural[c];
#endif
}

#if HMOE_LEVEL == 2
// e^x in every lane, within 2 ulp of expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (Cephes'
// coefficients), times 2^n by scalef. x is first clamped to [-104, 89], where e^x is already 0 / inf in fp32, so that
// infinities saturate as expf's do instead of turning the reduction into inf - inf; NaN passes the clamp (max / min
// return their second operand when either is NaN) and comes out NaN, as from expf.
inline __m512 exp_lanes(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// h[c] = silu(g[c]) * u[c] for c < n: the gated activation between an expert's two projections. Every element takes
// the same operations wherever it falls in a run (the AVX-512 level masks its last vector rather than finishing in
// scalar code), so a pair's h does not depend on which route or work item computed it. The scalar expf calls took
// a tenth of an int8 prefill layer (benchmarks/RESULTS.md, 2026-11-26 night).
void silu_rows(const float* g, const float* u, int64_t n, float* h) {
#if HMOE_LEVEL == 2
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = n - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - c)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + c), uv = _mm512_maskz_loadu_ps(m, u + c);
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_mask_storeu_ps(h + c, m, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)), uv));
  }
#else
  for (int64_t c = 0; c < n; ++c) h[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
#endif
}
