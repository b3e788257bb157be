// AMX bf16 tiles for the prefill route (see amx_gemm.h). Compiled for any x86-64 CPU: the AMX instructions sit in
// functions with their own target attribute and run only where amx_available() said yes.
#include "amx_gemm.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

// AMX intrinsics need GCC 11 or clang 12; older compilers build the rest of the kernel without this route.
#if defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) ? __clang_major__ >= 12 : defined(__GNUC__) && __GNUC__ >= 11)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HMOE_AMX 1
#endif

namespace {

constexpr int64_t kTile = 16;              // tile rows; tokens per block of the packed activations
constexpr int64_t kBlock = kTile * kTile;  // uint32 in one 16 x 32 block of packed activations
constexpr int64_t kTileBytes = 64;         // bytes per tile row

#ifdef HMOE_AMX
// Linux's tile-data permission: the kernel allocates the large XSAVE state only for processes that ask.
constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXfeatureTileData = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: sums (rows 0-15 / 16-31 x tokens of block 0 / 1); 4-5: weight rows; 6-7: activation blocks.
const TileConfig& tile_config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int i = 0; i < 8; ++i) {
      c.colsb[i] = kTileBytes;
      c.rows[i] = kTile;
    }
    return c;
  }();
  return config;
}

constexpr int64_t kBlocksAhead = 8;  // column blocks of a weight's rows prefetched ahead of the one laid out
constexpr int64_t kPanelBlock = kAmxRows * kAmxCols;  // bf16 of one column block of a panel: its two weight tiles
constexpr int64_t kChunkBlocks = 8;  // column blocks per chunk: 16 KiB of a panel, kept in L1 while the tokens pass

// One block of 16 (or, TWO, 32) tokens times the weight's 32 rows over column blocks [kb0, kb1), added to the sums
// in acc [4][16][16] (LOAD; else acc is overwritten).
template <bool TWO, bool LOAD>
__attribute__((target("amx-tile,amx-bf16"))) void tile_block(const AmxWeights& w, int64_t kb0, int64_t kb1,
                                                             const uint32_t* x0, const uint32_t* x1, float* acc) {
  if (LOAD) {
    _tile_loadd(0, acc, kTileBytes);
    _tile_loadd(2, acc + kBlock, kTileBytes);
    _tile_loadd(1, acc + 2 * kBlock, kTileBytes);
    _tile_loadd(3, acc + 3 * kBlock, kTileBytes);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    _tile_loadd(4, w.data + kb * w.block, w.stride);
    _tile_loadd(6, x0 + kb * kBlock, kTileBytes);
    _tile_loadd(5, w.data + kb * w.block + w.half, w.stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (TWO) {
      _tile_loadd(7, x1 + kb * kBlock, kTileBytes);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, kTileBytes);
  _tile_stored(2, acc + kBlock, kTileBytes);
  if (TWO) {
    _tile_stored(1, acc + 2 * kBlock, kTileBytes);
    _tile_stored(3, acc + 3 * kBlock, kTileBytes);
  }
}

// 32 columns of an int8 or packed int4 row as bf16 (q * s rounded to nearest even). int4 has 16 values: their 16
// products are rounded once into a table and looked up by nibble, the same bf16 as multiplying each column, in about
// half the instructions (int4 panels 15-20% faster: benchmarks/RESULTS.md, 2026-11-26 night).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void dequant_block(const uint8_t* q, int bits, float s,
                                                                                 uint16_t* dst) {
  const __m512 scale = _mm512_set1_ps(s);
  if (bits == 8) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(hi, scale), _mm512_mul_ps(lo, scale)));
    return;
  }
  const __m512 values = _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                                      scale);  // q = stored nibble - 8
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), nibble = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(b, nibble), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  const __m256i columns =  // stored nibbles of columns 0-31, in order
      _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)), _mm_unpackhi_epi8(lo, hi), 1);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(columns), table));
}

__attribute__((target("amx-tile"))) void load_tiles() { _tile_loadconfig(&tile_config()); }
__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }
#endif

}  // namespace

bool amx_available() {
#ifdef HMOE_AMX
  static const bool available = [] {
    __builtin_cpu_init();  // panels and packing need AVX512-BF16 / BW, which every AMX CPU has; checked anyway
    if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512bf16")) return false;
    unsigned int eax, ebx, ecx, edx;
    // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    if (!((edx >> 22) & 1u) || !((edx >> 24) & 1u)) return false;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) != 0) return false;
    if (syscall(SYS_arch_prctl, kGetXcompPerm, &granted) != 0) return false;
    return ((granted >> kXfeatureTileData) & 1ul) != 0;
  }();
  return available;
#else
  return false;
#endif
}

int64_t amx_packed_size(int64_t n, int64_t K) { return (n + kTile - 1) / kTile * (K / kAmxCols) * kBlock; }

#ifdef HMOE_AMX
namespace {

// Lane i of a tile row's 16 lanes: row i of the block (stride kTile uint32), for scatters and gathers.
__attribute__((target("avx512f"))) inline __m512i tile_rows() {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(int(kTile)));
}

// amx_pack for one token whose row holds each 32-column block in natural order or (`pairs`) as its 16 even columns,
// then its 16 odd ones: a block's 16 pairs rounded with one instruction and scattered down its packed block's rows.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void pack_row(const float* row, bool pairs, int64_t K,
                                                                     uint32_t* base) {
  static const auto words = [] {  // word 2i: the even column i (word i), word 2i + 1: the odd one (word 16 + i)
    std::array<uint16_t, 32> w{};
    for (int i = 0; i < 32; ++i) w[i] = uint16_t(i % 2 * 16 + i / 2);
    return w;
  }();
  const __m512i interleave = _mm512_loadu_si512(words.data());
  const __m512i down = tile_rows();
  for (int64_t k = 0; k < K; k += kAmxCols, base += kBlock) {
    __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + k + 16), _mm512_loadu_ps(row + k));
    if (pairs) v = _mm512_permutexvar_epi16(interleave, v);
    _mm512_i32scatter_epi32(base, down, v, 4);
  }
}

// The layout of pos, if pack_row reads it: 0 natural, 1 pairs, -1 neither.
int packed_layout(const int64_t* pos, int64_t K) {
  bool natural = true, pairs = true;
  for (int64_t c = 0; c < K; ++c) {
    const int64_t j = c % kAmxCols;
    natural &= pos[c] == c;
    pairs &= pos[c] == c - j + (j % 2) * (kAmxCols / 2) + j / 2;
  }
  return natural ? 0 : pairs ? 1 : -1;
}

}  // namespace
#endif

void amx_pack(const float* const* rows, const int64_t* pos, int64_t n, int64_t K, uint32_t* dst) {
  TORCH_CHECK(K % kAmxCols == 0, "amx_pack: K must be a multiple of ", kAmxCols);
  const int64_t blocks = K / kAmxCols;
  std::memset(dst, 0, amx_packed_size(n, K) * sizeof(uint32_t));
#ifdef HMOE_AMX
  if (const int layout = amx_available() ? packed_layout(pos, K) : -1; layout >= 0) {
    for (int64_t t = 0; t < n; ++t) pack_row(rows[t], layout == 1, K, dst + (t / kTile) * blocks * kBlock + t % kTile);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* row = rows[t];
    uint32_t* base = dst + (t / kTile) * blocks * kBlock + t % kTile;
    for (int64_t p = 0; p < K / 2; ++p)  // pair p: row p % 16 of block p / 16, column t % 16
      base[(p / kTile) * kBlock + (p % kTile) * kTile] =
          uint32_t(c10::detail::round_to_nearest_even(row[pos[2 * p]])) |
          uint32_t(c10::detail::round_to_nearest_even(row[pos[2 * p + 1]])) << 16;
  }
}

#ifdef HMOE_AMX
__attribute__((target("avx512f,avx512bw,avx512bf16")))
#endif
void amx_panel(const uint8_t* data, int64_t row_bytes, const uint16_t* scale, int64_t group, int bits, int64_t K,
               uint16_t* dst) {
#ifdef HMOE_AMX
  TORCH_CHECK(bits == 8 || bits == 4, "amx_panel: int8 or int4 weights");
  const int64_t groups = K / group;            // no division in the loop: a division per block costs more than it
  for (int64_t k = 0; k < K; k += kAmxCols) {  // the panel written front to back, the rows read side by side
    uint16_t* out = dst + k / kAmxCols * kPanelBlock;
    const uint8_t* column = data + k * bits / 8;
    const uint16_t* scales = scale + k / group;
    const bool prefetch = k * bits % 512 == 0 && k + kBlocksAhead * kAmxCols < K;  // once per cache line of a row
    for (int64_t r = 0; r < kAmxRows; ++r, out += kAmxCols) {
      const uint8_t* q = column + r * row_bytes;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(q + kBlocksAhead * kAmxCols * bits / 8), _MM_HINT_T0);
      dequant_block(q, bits, c10::detail::fp16_ieee_to_fp32_value(scales[r * groups]), out);
    }
  }
#else
  TORCH_CHECK(false, "amx_panel: no AMX on this build");
#endif
}

#ifdef HMOE_AMX
__attribute__((target("avx512f")))
#endif
void amx_rows(const AmxWeights& w, int64_t K, const uint32_t* x_packed, int64_t n, float* out, int64_t ld) {
#ifdef HMOE_AMX
  const int64_t token_blocks = (n + kTile - 1) / kTile, blocks = K / kAmxCols, stride = blocks * kBlock;
  // With more than one pass of token blocks over a panel, the passes go a chunk of columns at a time, so that the
  // panel's chunk is read from L1 by every pass. Rows read in place pass the whole K at once: rows whose stride is a
  // multiple of 4 KiB share L1 sets, so their chunks come from L2 anyway, and the chunks' reloads of the sums cost
  // more than they kept (benchmarks/RESULTS.md, 2026-11-26 night).
  const bool panel = w.block == kPanelBlock;  // rows in place step kAmxCols from one block to the next
  const int64_t chunk = panel && token_blocks > 2 ? kChunkBlocks : blocks;
  thread_local std::vector<float> sums;
  sums.resize((token_blocks + 1) / 2 * 4 * kBlock);
  for (int64_t kb = 0; kb < blocks; kb += chunk)
    for (int64_t tb = 0; tb < token_blocks; tb += 2) {
      const uint32_t* x0 = x_packed + tb * stride;
      float* acc = sums.data() + tb / 2 * 4 * kBlock;
      const int64_t kb1 = std::min(blocks, kb + chunk);
      if (tb + 1 < token_blocks) {
        if (kb)
          tile_block<true, true>(w, kb, kb1, x0, x0 + stride, acc);
        else
          tile_block<true, false>(w, kb, kb1, x0, x0 + stride, acc);
      } else if (kb) {
        tile_block<false, true>(w, kb, kb1, x0, nullptr, acc);
      } else {
        tile_block<false, false>(w, kb, kb1, x0, nullptr, acc);
      }
    }
  const __m512i down = tile_rows();
  for (int64_t t = 0; t < n; ++t) {
    float* o = out + t * ld;
    // token t's sums: tile pair t / 32, block (t / 16) % 2 of it, column t % 16; rows 0-15, then rows 16-31
    const float* s = sums.data() + t / (2 * kTile) * 4 * kBlock + (t / kTile) % 2 * 2 * kBlock + t % kTile;
    _mm512_storeu_ps(o, _mm512_i32gather_ps(down, s, 4));
    _mm512_storeu_ps(o + kTile, _mm512_i32gather_ps(down, s + kBlock, 4));
  }
#else
  TORCH_CHECK(false, "amx_rows: no AMX on this build");
#endif
}

AmxTiles::AmxTiles() {  // the caller checked amx_available() on its own thread: nothing here may throw
#ifdef HMOE_AMX
  load_tiles();
#endif
}

AmxTiles::~AmxTiles() {
#ifdef HMOE_AMX
  release_tiles();
#endif
}
