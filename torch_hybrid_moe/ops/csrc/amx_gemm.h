// The prefill route on CPUs with AMX (Intel Sapphire Rapids and later): 32 weight rows at a time times an expert's
// tokens in bf16 tiles, fp32 sums. Why our own: oneDNN's bf16 GEMM reorders the whole weight for every call, a cost
// an expert's 16-128 tokens do not amortise, and int8 / int4 weights had to be dequantised whole before it could
// start. Here the tiles read 32 bf16 rows at a time in place, or int8 / int4 rows dequantised into an L2-sized panel,
// and the few activation rows are reordered once per expert (benchmarks/RESULTS.md, 2026-11-26 afternoon and night).
#pragma once

#include <cstdint>

// True where the CPU has AMX-BF16 and the kernel granted this process the tile state (asked for on first call).
bool amx_available();

constexpr int64_t kAmxRows = 32;  // weight rows per amx_rows call: two tiles of 16
constexpr int64_t kAmxCols = 32;  // K must be a multiple of this: one tile row of bf16

// Size in uint32 of n activation rows of K columns packed for amx_rows.
int64_t amx_packed_size(int64_t n, int64_t K);

// Activation rows rows[0..n) (fp32, column c of K at rows[t][pos[c]]) rounded to bf16 (nearest even) and packed in
// natural column order as AMX's second operand: blocks of 16 tokens x 32 columns, column pairs side by side, tokens
// past n zero.
void amx_pack(const float* const* rows, const int64_t* pos, int64_t n, int64_t K, uint32_t* dst);

// Size in bf16 of a panel of kAmxRows weight rows of K columns.
constexpr int64_t amx_panel_size(int64_t K) { return kAmxRows * K; }

// kAmxRows rows of an int8 (bits 8) or packed int4 (bits 4, q + 8 in nibbles, low first) weight, row r at
// data + r * row_bytes with fp16 scales scale + r * (K / group), as the bf16 panel amx_rows multiplies (q * scale
// rounded to nearest even): by blocks of 32 columns, each its 32 rows' columns side by side, so that a tile loads 1 KiB
// in a row (rows of a weight lie a page apart, and 16 of them per tile load thrash the TLB).
void amx_panel(const uint8_t* data, int64_t row_bytes, const uint16_t* scale, int64_t group, int bits, int64_t K,
               uint16_t* dst);

// The weight operand of amx_rows: kAmxRows rows of K bf16 columns, where tiles load them from. A bf16 weight's own
// rows need no panel: its tiles read them in place, and the rows' reads from DRAM overlap the tiles' products, where a
// panel copied first made the two take turns (2026-11-26 night: 10-18% less time a bf16 prefill layer). Its rows lie a
// page apart, which the host store's huge pages keep from thrashing the TLB.
struct AmxWeights {
  const uint16_t* data;
  int64_t block;   // bf16 from one block of 32 columns to the next
  int64_t half;    // bf16 from rows 0-15 to rows 16-31
  int64_t stride;  // bytes from one row of a tile to the next
  static AmxWeights panel(const uint16_t* p) { return {p, kAmxRows * kAmxCols, kAmxRows * kAmxCols / 2, 2 * kAmxCols}; }
  static AmxWeights rows(const uint16_t* first, int64_t row_bytes) {
    return {first, kAmxCols, 16 * row_bytes / 2, row_bytes};
  }
};

// out[t * ld + r] = sum_k W[r, k] * x[t, k] for r < kAmxRows, t < n: x packed by amx_pack. Call while an AmxTiles
// lives on the same thread.
void amx_rows(const AmxWeights& w, int64_t K, const uint32_t* x_packed, int64_t n, float* out, int64_t ld);

// The tile configuration of amx_rows, loaded for this thread's lifetime of the object (the tile state is per thread).
class AmxTiles {
 public:
  AmxTiles();
  ~AmxTiles();
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};
