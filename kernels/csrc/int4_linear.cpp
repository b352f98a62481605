// int4 weight-only linears (W4A16, grouped scales, symmetric or asymmetric): on AVX-512 BF16 with
// vdpbf16ps, else (AVX-512F or AVX2 + FMA, the build's target decides) with the same pairs widened to
// float32 and FMA.
//
// A decode step reads every weight once, so a 4-bit weight is a quarter of a bfloat16 one's
// bytes; what matters is turning nibbles into products without spending more than the memory
// saves. The weight is packed once, at load, per block of 32 output columns: [N/32][K/8][32]
// 32-bit words (each pair of groups' words alternating: stored_words), word (kw, c) holding the 8 nibbles u = q + 8
// of column c at k = 8 kw .. 8 kw + 7,
// placed so that (word >> 4j) & 0x000F000F is the pair (u[2j], u[2j + 1]) in two 16-bit halves.
// OR-ing 0x4300 into each half makes the bfloat16 numbers 128 + u exactly, so one shift and one
// ternary-logic op give a pair vdpbf16ps multiplies against a broadcast pair of x. Per group the
// float32 sum is S = sum (128 + u) x; the weight is (u - 8 - z) s, so y += s (S - (136 + z) sum x),
// with sum x over the group computed once per row. Products of a bfloat16 x and 128 + u are exact
// in float32; the sums lose about 4 bits of float32's 24 to the offset, far below the bfloat16
// output's rounding. Rows go in tiles of 4/2/1, each weight load serving every row of the tile; each group's pairs
// are summed in order, in one chain a row and vector, on every path.
//
// Without vdpbf16ps a nibble is masked in place and converted as an integer: word & (15 << 4j) is
// u[2j] 16^j, and (word >> 16) & (15 << 4j) is u[2j + 1] 16^j, each multiplied with FMA by x[k] 16^-j
// (scaled once per call; exact, as is every product). The sums are then S' = sum u x, with no 128
// offset, and y += s (S' - (8 + z) sum x) per group: two integer ops a vector of products, where the
// exponent trick above would take five without ternary logic.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#if defined(__AMX_TILE__)
#include "amx_tiles.h"
#endif
#include "call_buffer.h"
#include "float_storage.h"
#include "prefetch.h"
#include "simd_math.h"
#include "work_split.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t BLOCK_N = 32;  // output columns per weight block

// Rows a work item of a prompt chunk, where each item widens its block once first (int8_linear.cpp's choice: the
// other kernels' 48 widened each block of a 256-token prompt 6 times)
constexpr int64_t kWidenedRowChunk = 128;

// What both instruction-set paths below check before reading anything: the shapes and dtypes
// kernels/int4_linear.py packs (blocks of 32 columns); the offsets' and bias's data, or nullptr.
struct Int4Inputs {
  int64_t m, k, blocks, groups;
  const float* offsets;
  const float* bias;
};
inline Int4Inputs check_int4_inputs(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                                    const c10::optional<torch::Tensor>& offsets, int64_t n,
                                    const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_linear: x must be a contiguous [M, K] bfloat16 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.is_contiguous() && packed.size(2) == BLOCK_N,
              "int4_linear: the weight must be packed by kernels/int4_linear.py");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) * 8 == k, "int4_linear: x has ", k, " features, the packed weight ", packed.size(1) * 8);
  TORCH_CHECK(n > (blocks - 1) * BLOCK_N && n <= blocks * BLOCK_N, "int4_linear: ", n,
              " output features do not match the packed weight's ", blocks, " blocks");
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == blocks && scales.size(2) == BLOCK_N && scales.size(1) > 0 &&
                  k % (8 * scales.size(1)) == 0,
              "int4_linear: scales must be float32 [blocks, groups, 32] with K a multiple of 8 x groups");
  const int64_t groups = scales.size(1);
  const float* off = nullptr;
  if (offsets.has_value()) {
    TORCH_CHECK(offsets->scalar_type() == at::kFloat && offsets->is_contiguous() && offsets->sizes() == scales.sizes(),
                "int4_linear: offsets must be float32 of the scales' shape");
    off = offsets->data_ptr<float>();
  }
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "int4_linear: bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  return {m, k, blocks, groups, off, b};
}

// Where a block stores a group's words (repack_words): groups in pairs, word i of group g at 2 i + (g & 1) from the
// pair's first word, so a decode tile reads two groups side by side from one sequential stream and sums each in
// chains of its own (four vdpbf16ps chains a decode row, where summing one group's even and odd pairs apart made
// a prompt tile run every group twice); the last group of an odd count as it is. Word i of group g: first + i stride.
struct GroupWords {
  int64_t first, stride;
};
inline GroupWords stored_words(int64_t g, int64_t group_words, int64_t groups) {
  if ((g | 1) >= groups) return {g * group_words, 1};
  return {(g & ~int64_t{1}) * group_words + (g & 1), 2};
}
// Where a block stores its word kw (of group kw / group_words)
inline int64_t stored_word(int64_t kw, int64_t group_words, int64_t groups) {
  const int64_t g = kw / group_words;
  const GroupWords at = stored_words(g, group_words, groups);
  return at.first + (kw - g * group_words) * at.stride;
}

}  // namespace

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

struct Args {
  const uint16_t* x;  // [M, K] bfloat16
  const float* xsum;  // [M, G]: sum of x over each group
  const uint32_t* w;  // [N/32][K/8][32]
  const float* scale;  // [N/32][G][32]
  const float* offset;  // [N/32][G][32]: 136 + z, or nullptr (symmetric: 136)
  const float* bias;  // [N] or nullptr
  uint16_t* y;        // [M, N] bfloat16
  int64_t m, n, k, groups, group_words;
};

// The sums of groups g .. g + GROUPS over ROWS rows for one 32-column block: each group's pairs in order, one
// vdpbf16ps chain a row, vector and group, the sums a prompt tile makes. Two groups give a decode row four chains,
// which hide vdpbf16ps's latency, read from one stream (stored_words: a pair of groups' words alternate).
template <int ROWS, int GROUPS>
inline void group_sums(const Args& a, const uint32_t* wb, int64_t g, int64_t r0, __m512 (&acc)[GROUPS][ROWS][2]) {
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
  for (int q = 0; q < GROUPS; ++q)
    for (int r = 0; r < ROWS; ++r) acc[q][r][0] = acc[q][r][1] = _mm512_setzero_ps();
  const GroupWords at = stored_words(g, a.group_words, a.groups);
  for (int64_t i = 0; i < a.group_words; ++i) {
    __m512i v[GROUPS][2];
    for (int q = 0; q < GROUPS; ++q) {
      const uint32_t* word = wb + (at.first + i * at.stride + q) * BLOCK_N;
      infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(word);
      infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(word + 16);
      v[q][0] = _mm512_loadu_si512(word);
      v[q][1] = _mm512_loadu_si512(word + 16);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      for (int q = 0; q < GROUPS; ++q) {
        // (v >> 4j) & 0x000F000F | 0x43004300: truth table 0xEA is (A & B) | C
        const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(v[q][0], 4 * j), nibbles, exponent, 0xEA);
        const __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(v[q][1], 4 * j), nibbles, exponent, 0xEA);
        const int64_t k = 8 * ((g + q) * a.group_words + i) + 2 * j;
        for (int r = 0; r < ROWS; ++r) {
          int32_t pair;
          std::memcpy(&pair, a.x + (r0 + r) * a.k + k, sizeof(pair));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
          acc[q][r][0] = _mm512_dpbf16_ps(acc[q][r][0], w0, xv);
          acc[q][r][1] = _mm512_dpbf16_ps(acc[q][r][1], w1, xv);
        }
      }
  }
}

// y += s (S - o sum x) for group g's sums S of a block's 16-column vector h (o: 136 + z, or 136), the one step
// every path takes per group, row and vector
inline __m512 scaled_group(const Args& a, int64_t blk, int64_t g, int h, int64_t row, __m512 sum, __m512 y) {
  const int64_t at = (blk * a.groups + g) * BLOCK_N + 16 * h;
  const __m512 o = a.offset != nullptr ? _mm512_loadu_ps(a.offset + at) : _mm512_set1_ps(136.f);
  const __m512 xs = _mm512_set1_ps(a.xsum[row * a.groups + g]);
  return _mm512_fmadd_ps(_mm512_loadu_ps(a.scale + at), _mm512_fnmadd_ps(o, xs, sum), y);
}

// y += groups g .. g + GROUPS of one 32-column block over ROWS rows: their sums (group_sums), scaled in group order
template <int ROWS, int GROUPS>
inline void add_groups(const Args& a, const uint32_t* wb, int64_t blk, int64_t g, int64_t r0, __m512 (&y)[ROWS][2]) {
  __m512 acc[GROUPS][ROWS][2];
  group_sums<ROWS, GROUPS>(a, wb, g, r0, acc);
  for (int q = 0; q < GROUPS; ++q)
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < 2; ++h) y[r][h] = scaled_group(a, blk, g + q, h, r0 + r, acc[q][r][h], y[r][h]);
}

// y[r0 .. r0 + ROWS, block columns] for one 32-column block: groups two at a time (the stored pairs), an odd count's
// last alone.
template <int ROWS>
inline void tile(const Args& a, int64_t blk, int64_t r0) {
  const uint32_t* wb = a.w + blk * (a.k / 8) * BLOCK_N;
  __m512 y[ROWS][2];
  for (int r = 0; r < ROWS; ++r) y[r][0] = y[r][1] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= a.groups; g += 2) add_groups<ROWS, 2>(a, wb, blk, g, r0, y);
  if (g < a.groups) add_groups<ROWS, 1>(a, wb, blk, g, r0, y);
  for (int h = 0; h < 2; ++h) {
    const int64_t col = blk * BLOCK_N + 16 * h;
    if (col >= a.n) break;
    const __mmask16 live = col + 16 <= a.n ? 0xFFFF : static_cast<__mmask16>((1u << (a.n - col)) - 1);
    const __m512 b = a.bias != nullptr ? _mm512_maskz_loadu_ps(live, a.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r)
      _mm256_mask_storeu_epi16(a.y + (r0 + r) * a.n + col, live, infer::to_bf16(_mm512_add_ps(y[r][h], b)));
  }
}

// Tiles of 4 rows at most: 16 sums and 8 outputs of 32 registers.
void rows(const Args& a, int64_t blk, int64_t r, int64_t r1) {
  for (; r + 4 <= r1; r += 4) tile<4>(a, blk, r);
  for (; r + 2 <= r1; r += 2) tile<2>(a, blk, r);
  for (; r < r1; ++r) tile<1>(a, blk, r);
}

// A prompt chunk: the block's pairs made once a work item (the very vectors `tile` makes, 4 K/8 x 2 of them,
// K x 64 bytes, in cache), then tiles of rows that do nothing but vdpbf16ps on them: the same products summed in
// the same order, so every row's result is the one `tile` gives, bit for bit. Decoding the nibbles in every tile
// of 6 rows left a 256-row chunk at 0.84x the bfloat16 linear's rate on Zen 5.
// tiled (AMX prompt chunks): as B tiles instead, [K/32][2][16 pairs][16 columns] words, each tile a contiguous 1 KiB
inline void widen_block_pairs(const Args& a, int64_t blk, int32_t* wp, bool tiled = false) {
  const int64_t words = a.k / 8;
  const uint32_t* wb = a.w + blk * words * BLOCK_N;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F), exponent = _mm512_set1_epi32(0x43004300);
  for (int64_t kw = 0; kw < words; ++kw) {
    const uint32_t* word = wb + stored_word(kw, a.group_words, a.groups) * BLOCK_N;
    infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(word);
    infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(word + 16);
    const __m512i v0 = _mm512_loadu_si512(word), v1 = _mm512_loadu_si512(word + 16);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int64_t p = 4 * kw + j;  // the pair (k = 2p, 2p + 1)
      int32_t* out = tiled ? wp + (p / 16 * 2 * 16 + p % 16) * 16 : wp + p * BLOCK_N;
      _mm512_storeu_si512(out, _mm512_ternarylogic_epi32(_mm512_srli_epi32(v0, 4 * j), nibbles, exponent, 0xEA));
      _mm512_storeu_si512(out + (tiled ? 256 : 16),
                          _mm512_ternarylogic_epi32(_mm512_srli_epi32(v1, 4 * j), nibbles, exponent, 0xEA));
    }
  }
}

// y[r0 .. r0 + ROWS, columns of blocks blk .. blk + BLOCKS) from the blocks' widened pairs wp[0 .. BLOCKS).
// Two blocks a tile (6 rows x 4 vectors) load 4 weight vectors and 6 broadcasts for 24 products where one block
// (12 x 2) loads 2 and 12: bf16_linear.cpp's 64-column shape.
template <int ROWS, int BLOCKS>
inline void tile_pairs(const Args& a, const int32_t* const* wp, int64_t blk, int64_t r0) {
  constexpr int V = 2 * BLOCKS;  // vectors of 16 columns
  const int64_t pairs = 4 * a.group_words;  // k pairs a group
  alignas(64) float y[ROWS][V][16] = {};
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512 acc[ROWS][V];
    const uint16_t* xg = a.x + r0 * a.k + 2 * g * pairs;
#pragma GCC unroll 64
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {  // `group_sums`'s chains
      __m512bh w[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wp[v / 2] + (g * pairs + p) * BLOCK_N + 16 * (v % 2));
#pragma GCC unroll 64
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, xg + r * a.k + 2 * p, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], xv);
      }
    }
#pragma GCC unroll 64
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        _mm512_store_ps(y[r][v], scaled_group(a, blk + v / 2, g, v % 2, r0 + r, acc[r][v], _mm512_load_ps(y[r][v])));
  }
  for (int v = 0; v < V; ++v) {
    const int64_t col = blk * BLOCK_N + 16 * v;
    if (col >= a.n) break;
    const __mmask16 live = col + 16 <= a.n ? 0xFFFF : static_cast<__mmask16>((1u << (a.n - col)) - 1);
    const __m512 b = a.bias != nullptr ? _mm512_maskz_loadu_ps(live, a.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r)
      _mm256_mask_storeu_epi16(a.y + (r0 + r) * a.n + col, live, infer::to_bf16(_mm512_add_ps(_mm512_load_ps(y[r][v]), b)));
  }
}

// Blocks a prompt chunk's work item widens and tiles together: two made a 256-row chunk of the embedded
// model's linears 0.91-0.92x the bfloat16 kernel's rate where one gave 0.89-0.90x (Zen 5, g64; qkv and o at
// 0.99x). What remains is the per-group scaling, 2 FMAs a row, column and group (6% of the products at g64).
constexpr int64_t kPairBlocks = 2;

// Rows r .. r1 of BLOCKS blocks: tiles of 24 sums (of 32 registers; y waits in memory per group), then pairs
// and single rows.
template <int BLOCKS>
void tile_rows(const Args& a, const int32_t* const* wp, int64_t blk, int64_t r, int64_t r1) {
  constexpr int kRows = 12 / BLOCKS;
  for (; r + kRows <= r1; r += kRows) tile_pairs<kRows, BLOCKS>(a, wp, blk, r);
  for (; r + 2 <= r1; r += 2) tile_pairs<2, BLOCKS>(a, wp, blk, r);
  for (; r < r1; ++r) tile_pairs<1, BLOCKS>(a, wp, blk, r);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Prompt chunks on AMX tiles (the `amx` class; 16 rows or more, K and each group whole tiles of 32 k): a block's
// pairs (128 + u as bfloat16, as widen_block_pairs makes them) laid out as B tiles, [K/32][2][16 pairs][16 columns]
// words, each a contiguous 1 KiB, against the rows of x as A tiles; per group, C tiles 0-3 (32 rows x the block's
// 32 columns) sum that group's products, then y += s (S - o sum x) as scaled_group does, while the tiles work on
// the next group. The same exact products summed in float32 in the tiles' order: within the float32 sums' rounding
// of a decode row's result, not bit for bit (tests/test_int4_linear.py).
inline bool amx_prompt(int64_t m, int64_t k, int64_t group) {
  return m >= 16 && k % 32 == 0 && group % 32 == 0 && infer::amx_granted();
}

// y[r .. r1, block blk's columns] from its tiles wt; xa: the rows of x on cache lines (K values apart), readable for
// 32 rows past r1 (rows past r1 are never stored)
void amx_rows(const Args& a, const uint16_t* xa, int64_t blk, const int32_t* wt, int64_t r, int64_t r1) {
  infer::configure_tiles();
  const int64_t tiles_a_group = 8 * a.group_words / 32, lda = 2 * a.k;
  alignas(64) float sums[2][32][32];
  alignas(64) float y[32][32];
  for (int64_t i = r; i < r1; i += 32) {
    const bool two = i + 16 < r1;
    const int64_t rows = std::min<int64_t>(32, r1 - i);
    // y += s (S - o sum x) for group g's sums S (as scaled_group, in group order)
    auto add_group = [&](int64_t g, const float (*s)[32]) {
      for (int h = 0; h < 2; ++h) {
        const int64_t at = (blk * a.groups + g) * BLOCK_N + 16 * h;
        const __m512 o = a.offset != nullptr ? _mm512_loadu_ps(a.offset + at) : _mm512_set1_ps(136.f);
        const __m512 scale = _mm512_loadu_ps(a.scale + at);
        for (int64_t q = 0; q < rows; ++q) {
          const __m512 xs = _mm512_set1_ps(a.xsum[(i + q) * a.groups + g]);
          _mm512_store_ps(y[q] + 16 * h, _mm512_fmadd_ps(scale, _mm512_fnmadd_ps(o, xs, _mm512_load_ps(s[q] + 16 * h)),
                                                         _mm512_load_ps(y[q] + 16 * h)));
        }
      }
    };
    for (int64_t q = 0; q < rows; ++q) std::memset(y[q], 0, sizeof(y[q]));
    for (int64_t g = 0; g < a.groups; ++g) {
      infer::zero_accumulators(two);
      for (int64_t t = 0; t < tiles_a_group; ++t) {
        const int64_t kb = g * tiles_a_group + t;
        infer::tile_step<false>(xa + i * a.k + kb * 32, lda, wt + kb * 512, wt + kb * 512 + 256, 64, two);
      }
      if (g > 0) add_group(g - 1, sums[(g - 1) & 1]);
      infer::store_accumulators(sums[g & 1], two);
    }
    add_group(a.groups - 1, sums[(a.groups - 1) & 1]);
    for (int h = 0; h < 2; ++h) {
      const int64_t col = blk * BLOCK_N + 16 * h;
      if (col >= a.n) break;
      const __mmask16 live = col + 16 <= a.n ? 0xFFFF : static_cast<__mmask16>((1u << (a.n - col)) - 1);
      const __m512 b = a.bias != nullptr ? _mm512_maskz_loadu_ps(live, a.bias + col) : _mm512_setzero_ps();
      for (int64_t q = 0; q < rows; ++q)
        _mm256_mask_storeu_epi16(a.y + (i + q) * a.n + col, live, infer::to_bf16(_mm512_add_ps(_mm512_load_ps(y[q] + 16 * h), b)));
    }
  }
  _tile_release();
}
#else
inline bool amx_prompt(int64_t, int64_t, int64_t) { return false; }
#endif

// Rows r .. r1 of blocks blk .. blk + kPairBlocks (one at an odd weight's last block), each widened once first.
void rows_widened(const Args& a, int64_t blk, int64_t r, int64_t r1, int64_t blocks) {
  thread_local std::vector<int32_t> buffer;
  const int64_t size = a.k / 2 * BLOCK_N, count = std::min(kPairBlocks, blocks - blk);
  buffer.resize(kPairBlocks * size);
  const int32_t* wp[2] = {buffer.data(), buffer.data() + (kPairBlocks - 1) * size};
  for (int64_t b = 0; b < count; ++b) widen_block_pairs(a, blk + b, buffer.data() + b * size);
  if (count == 2)
    tile_rows<2>(a, wp, blk, r, r1);
  else
    tile_rows<1>(a, wp, blk, r, r1);
}

}  // namespace

// x: [M, K] bfloat16, contiguous; packed: [ceil(N/32), K/8, 32] int32, scales (and offsets, or None):
// [ceil(N/32), G, 32] float32 (kernels/int4_linear.py); bias: float32 [N] or None. Returns [M, N] bfloat16.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                          int64_t n, c10::optional<torch::Tensor> bias) {
  const Int4Inputs in = check_int4_inputs(x, packed, scales, offsets, n, bias);
  const int64_t m = in.m, k = in.k, blocks = in.blocks, groups = in.groups;
  const float *off = in.offsets, *b = in.bias;
  auto y = torch::empty({m, n}, x.options());
  // sum of x over each group, in float32, from the bfloat16 values the products use (a prompt chunk's rows over
  // the threads)
  float* xsum = infer::call_buffer<float, 1>(m * groups);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t group_size = k / groups;
  const bool widened = m >= infer::kDynamicRows;
  auto sum_row = [&](int64_t r) {
    for (int64_t g = 0; g < groups; ++g) {
      __m512 s = _mm512_setzero_ps();
      int64_t i = g * group_size;
      for (; i + 16 <= (g + 1) * group_size; i += 16)
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + r * k + i))), 16)));
      float t = _mm512_reduce_add_ps(s);
      for (; i < (g + 1) * group_size; ++i) {
        const uint32_t bits = static_cast<uint32_t>(xp[r * k + i]) << 16;
        float f;
        std::memcpy(&f, &bits, sizeof(f));
        t += f;
      }
      xsum[r * groups + g] = t;
    }
  };
  if (widened)
    at::parallel_for(0, m, 1, [&](int64_t first, int64_t last) {
      for (int64_t r = first; r < last; ++r) sum_row(r);
    });
  else
    for (int64_t r = 0; r < m; ++r) sum_row(r);
  const Args a{xp, xsum, reinterpret_cast<const uint32_t*>(packed.data_ptr()), scales.data_ptr<float>(), off, b,
               reinterpret_cast<uint16_t*>(y.data_ptr()), m, n, k, groups, group_size / 8};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx_prompt(a.m, a.k, 8 * a.group_words)) {
    // x's rows copied onto cache lines, with 32 rows to spare (a partial row tile reads past the last row)
    uint16_t* xa = infer::align_up(infer::call_buffer<uint16_t, 2>((m + 32) * k + 32), 64);
    at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
      std::memcpy(xa + first * k, xp + first * k, (last - first) * k * sizeof(uint16_t));
    });
    infer::for_blocks_and_rows(m, blocks, [&](int64_t blk, int64_t r0, int64_t r1) {
      thread_local std::vector<int32_t> tiles;
      tiles.resize(k / 2 * BLOCK_N);
      widen_block_pairs(a, blk, tiles.data(), true);
      amx_rows(a, xa, blk, tiles.data(), r0, r1);
    }, kWidenedRowChunk);
    return y;
  }
#endif
  if (widened)
    infer::for_blocks_and_rows(
        m, (blocks + kPairBlocks - 1) / kPairBlocks,
        [&](int64_t item, int64_t r0, int64_t r1) { rows_widened(a, item * kPairBlocks, r0, r1, blocks); },
        kWidenedRowChunk);
  else
    infer::for_blocks_and_rows(m, blocks, [&](int64_t blk, int64_t r0, int64_t r1) { rows(a, blk, r0, r1); });
  return y;
}

bool available() { return true; }
// whether a prompt chunk (16 rows) with K k in groups of `group` runs on AMX-BF16 tiles in this process
bool prompt_tiles(int64_t k, int64_t group) { return amx_prompt(16, k, group); }

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
using vf = __m512;
using vi = __m512i;
constexpr int kLanes = 16;
inline vi vload_words(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline vi vwords(uint32_t w) { return _mm512_set1_epi32(static_cast<int>(w)); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vi vsrl16(vi v) { return _mm512_srli_epi32(v, 16); }
inline vf vsub128(vf v) { return _mm512_sub_ps(v, _mm512_set1_ps(128.f)); }
inline vi vand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vi vsrl(vi v, int n) { return _mm512_srli_epi32(v, n); }
inline vf load_bf16(const uint16_t* p) {  // 16 bfloat16 widened (exact)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#else
using vf = __m256;
using vi = __m256i;
constexpr int kLanes = 8;
inline vi vload_words(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi vwords(uint32_t w) { return _mm256_set1_epi32(static_cast<int>(w)); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vi vsrl16(vi v) { return _mm256_srli_epi32(v, 16); }
inline vf vsub128(vf v) { return _mm256_sub_ps(v, _mm256_set1_ps(128.f)); }
inline vi vand(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vi vsrl(vi v, int n) { return _mm256_srli_epi32(v, n); }
inline vf load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif
constexpr int V = BLOCK_N / kLanes;  // vectors a block row
constexpr float kNibbleScale[4] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096};  // 16^-j, exact
constexpr float kSymmetricOffset = 8.f;  // 136 less 128: the sums hold x u

struct Args {
  const float* x;     // [M, K] float32: the bfloat16 input widened exactly (times 16^-j for `tile`, as it is for
                      // `tile_widened`)
  const float* xsum;  // [M, G]: sum of x over each group
  const uint32_t* w;  // [N/32][K/8][32]
  const float* scale;  // [N/32][G][32]
  const float* offset;  // [N/32][G][32]: 136 + z, or nullptr (symmetric: 136)
  const float* bias;  // [N] or nullptr
  uint16_t* y;        // [M, N] bfloat16
  int64_t m, n, k, groups, group_words;
};

// The sums of groups g .. g + GROUPS over ROWS rows for one block: each group's k in order, one FMA chain a row,
// vector and group (x 16^-j times u 16^j: exact products, the ones a prompt tile forms as x times u). Two groups
// side by side, read from one stream (stored_words), give a decode row 2 V chains, as a group's even and odd k
// summed apart did, and let a prompt tile run each group once.
template <int ROWS, int GROUPS>
inline void group_sums(const Args& a, const uint32_t* wb, int64_t g, int64_t r0, vf (&acc)[GROUPS][ROWS][V]) {
  for (int q = 0; q < GROUPS; ++q)
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < V; ++v) acc[q][r][v] = vzero();
  const GroupWords at = stored_words(g, a.group_words, a.groups);
  for (int64_t i = 0; i < a.group_words; ++i) {
    vi lo[GROUPS][V], hi[GROUPS][V];  // the even k's nibbles at bits 4j, and (shifted down once) the odd k's
    for (int q = 0; q < GROUPS; ++q) {
      const uint32_t* word = wb + (at.first + i * at.stride + q) * BLOCK_N;
      infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(word);
      infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(word + 16);
      for (int v = 0; v < V; ++v) {
        lo[q][v] = vload_words(word + v * kLanes);
        hi[q][v] = vsrl16(lo[q][v]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      const vi mask = vwords(0xFu << (4 * j));
      for (int q = 0; q < GROUPS; ++q)
        for (int r = 0; r < ROWS; ++r) {
          // x scaled by 16^-j (exact), so that u 16^j, the masked nibble read as an integer, needs no shift
          const float* xr = a.x + (r0 + r) * a.k + 8 * ((g + q) * a.group_words + i) + 2 * j;
          const vf xe = vbroadcast(xr), xo = vbroadcast(xr + 1);
          for (int v = 0; v < V; ++v) {
            acc[q][r][v] = vfma(xe, vcvt(vand(lo[q][v], mask)), acc[q][r][v]);
            acc[q][r][v] = vfma(xo, vcvt(vand(hi[q][v], mask)), acc[q][r][v]);
          }
        }
    }
  }
}

// y += s (S - o sum x) for group g's sums S of a block's vector v (the sums hold x u, no 128 + u here: o is the
// offset 136 + z less 128), the one step every path takes per group, row and vector
inline vf scaled_group(const Args& a, int64_t blk, int64_t g, int64_t c, int64_t row, vf sum, vf y) {
  const int64_t at = (blk * a.groups + g) * BLOCK_N + c;
  const vf o = a.offset != nullptr ? vsub128(vload(a.offset + at)) : vbroadcast(&kSymmetricOffset);
  return vfma(vload(a.scale + at), vfnma(o, vbroadcast(a.xsum + row * a.groups + g), sum), y);
}

// y += groups g .. g + GROUPS of one block over ROWS rows: their sums (group_sums), scaled in group order
template <int ROWS, int GROUPS>
inline void add_groups(const Args& a, const uint32_t* wb, int64_t blk, int64_t g, int64_t r0, vf (&y)[ROWS][V]) {
  vf acc[GROUPS][ROWS][V];
  group_sums<ROWS, GROUPS>(a, wb, g, r0, acc);
  for (int q = 0; q < GROUPS; ++q)
    for (int r = 0; r < ROWS; ++r)
      for (int v = 0; v < V; ++v) y[r][v] = scaled_group(a, blk, g + q, v * kLanes, r0 + r, acc[q][r][v], y[r][v]);
}

// y[r0 .. r0 + ROWS, block columns]: a decode row's groups two at a time (the stored pairs), more rows' one at a
// time (their rows give the chains), an odd count's last alone.
template <int ROWS>
inline void tile(const Args& a, int64_t blk, int64_t r0) {
  const uint32_t* wb = a.w + blk * (a.k / 8) * BLOCK_N;
  constexpr int GROUPS = ROWS == 1 ? 2 : 1;
  vf y[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) y[r][v] = vzero();
  int64_t g = 0;
  for (; g + GROUPS <= a.groups; g += GROUPS) add_groups<ROWS, GROUPS>(a, wb, blk, g, r0, y);
  if (g < a.groups) add_groups<ROWS, 1>(a, wb, blk, g, r0, y);
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < V; ++v) {
      const int64_t col = blk * BLOCK_N + v * kLanes;
      if (col >= a.n) break;
      alignas(64) float out[kLanes];
      vstore(out, y[r][v]);
      uint16_t* yr = a.y + (r0 + r) * a.n + col;
      for (int i = 0; i < kLanes && col + i < a.n; ++i)
        yr[i] = infer::from_float<at::BFloat16>(out[i] + (a.bias != nullptr ? a.bias[col + i] : 0.f)).x;
    }
}

void rows(const Args& a, int64_t blk, int64_t r, int64_t r1) {
  constexpr int kTileRows = kLanes == 16 ? 4 : 2;  // 2 x V sums a row: 16 of 32 registers, or 8 of 16
  for (; r + kTileRows <= r1; r += kTileRows) tile<kTileRows>(a, blk, r);
  for (; r + 2 <= r1; r += 2) tile<2>(a, blk, r);
  for (; r < r1; ++r) tile<1>(a, blk, r);
}

// A prompt chunk: each slice of 2 vectors of a block's columns widened once a work item to the float32 u (exact;
// K x 2 kLanes floats, in k order, in cache), then tiles of rows that do nothing but FMA, each group's k in order
// in one chain, as `group_sums` sums them (x u, exact, is the product `tile` forms as x 16^-j times u 16^j), so
// every row's result is the one `tile` gives, bit for bit. Masking and converting in every tile left a 256-row
// chunk at 0.6x the bfloat16 linear's rate on Zen 5 forced to avx2.
constexpr int kSlice = 2 * kLanes;  // columns a slice
constexpr int kWideRows = kLanes == 16 ? 12 : 6;  // 2 x rows sums, two weight vectors and a broadcast live

inline void widen_slice(const Args& a, int64_t blk, int64_t c0, float* wf) {
  const int64_t words = a.k / 8;
  const uint32_t* wb = a.w + blk * words * BLOCK_N + c0;
  const vi nibble = vwords(0xFu);
  for (int64_t kw = 0; kw < words; ++kw) {
    const uint32_t* word = wb + stored_word(kw, a.group_words, a.groups) * BLOCK_N;
    infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(word);
    float* out = wf + 8 * kw * kSlice;  // k = 8 kw + 2j at row 2j, 8 kw + 2j + 1 at row 2j + 1
    for (int v = 0; v < 2; ++v) {
      const vi lo = vload_words(word + v * kLanes), hi = vsrl16(lo);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        vstore(out + 2 * j * kSlice + v * kLanes, vcvt(vand(vsrl(lo, 4 * j), nibble)));
        vstore(out + (2 * j + 1) * kSlice + v * kLanes, vcvt(vand(vsrl(hi, 4 * j), nibble)));
      }
    }
  }
}

template <int ROWS>
inline void tile_widened(const Args& a, const float* wf, int64_t blk, int64_t c0, int64_t r0) {
  const int64_t group_size = 8 * a.group_words;
  alignas(64) float y[ROWS][2][kLanes] = {};
  for (int64_t g = 0; g < a.groups; ++g) {
    vf acc[ROWS][2];
#pragma GCC unroll 64
    for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = vzero();
    const float* w = wf + g * group_size * kSlice;
    const float* x = a.x + r0 * a.k + g * group_size;
    for (int64_t i = 0; i < group_size; ++i) {
      const vf w0 = vload(w + i * kSlice), w1 = vload(w + i * kSlice + kLanes);
#pragma GCC unroll 64
      for (int r = 0; r < ROWS; ++r) {
        const vf xb = vbroadcast(x + r * a.k + i);
        acc[r][0] = vfma(xb, w0, acc[r][0]);
        acc[r][1] = vfma(xb, w1, acc[r][1]);
      }
    }
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v)  // as `tile`
#pragma GCC unroll 64
      for (int r = 0; r < ROWS; ++r)
        vstore(y[r][v], scaled_group(a, blk, g, c0 + v * kLanes, r0 + r, acc[r][v], vload(y[r][v])));
  }
  for (int v = 0; v < 2; ++v) {
    const int64_t col = blk * BLOCK_N + c0 + v * kLanes;
    if (col >= a.n) break;
    for (int r = 0; r < ROWS; ++r) {
      uint16_t* yr = a.y + (r0 + r) * a.n + col;
      if (col + kLanes <= a.n) {
        infer::store_bf16(yr, vadd(vload(y[r][v]), a.bias != nullptr ? vload(a.bias + col) : vzero()));
        continue;
      }
      for (int i = 0; i < kLanes && col + i < a.n; ++i)
        yr[i] = infer::from_float<at::BFloat16>(y[r][v][i] + (a.bias != nullptr ? a.bias[col + i] : 0.f)).x;
    }
  }
}

void rows_widened(const Args& a, int64_t blk, int64_t r, int64_t r1) {
  thread_local std::vector<float> wf;
  wf.resize(a.k * kSlice);
  for (int64_t c0 = 0; c0 < BLOCK_N; c0 += kSlice) {
    if (blk * BLOCK_N + c0 >= a.n) break;
    widen_slice(a, blk, c0, wf.data());
    int64_t i = r;
    for (; i + kWideRows <= r1; i += kWideRows) tile_widened<kWideRows>(a, wf.data(), blk, c0, i);
    for (; i + 4 <= r1; i += 4) tile_widened<4>(a, wf.data(), blk, c0, i);
    for (; i + 2 <= r1; i += 2) tile_widened<2>(a, wf.data(), blk, c0, i);
    for (; i < r1; ++i) tile_widened<1>(a, wf.data(), blk, c0, i);
  }
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, c10::optional<torch::Tensor> offsets,
                          int64_t n, c10::optional<torch::Tensor> bias) {
  const Int4Inputs in = check_int4_inputs(x, packed, scales, offsets, n, bias);
  const int64_t m = in.m, k = in.k, blocks = in.blocks, groups = in.groups;
  const float *off = in.offsets, *b = in.bias;
  auto y = torch::empty({m, n}, x.options());
  // x widened once (exact), and its sum over each group: plain loops, since a torch op's dispatch alone
  // would cost a decode step's linear a good share of its time
  const auto* xp = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
  const int64_t group_size = k / groups;
  float* xf = infer::call_buffer<float>(m * k);
  float* xsum = infer::call_buffer<float, 1>(m * groups);
  const bool widened = m >= infer::kDynamicRows;
  if (!widened) {
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.f;
        for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
          const float v = infer::to_float(xp[r * k + i]);
          t += v;
          xf[r * k + i] = v * kNibbleScale[(i % 8) / 2];  // k = 8 kw + 2j (+1): nibble j sits at bits 4j
        }
        xsum[r * groups + g] = t;
      }
  } else {
    // a prompt chunk: x as it is, in vectors, 8 rows at a time over the threads; each row's group sums added in
    // the order above (8 rows' sums side by side, so the additions need not wait on one another)
    const auto* xb = reinterpret_cast<const uint16_t*>(xp);
    at::parallel_for(0, (m + 7) / 8, 1, [&](int64_t first, int64_t last) {
      for (int64_t r0 = 8 * first; r0 < std::min(m, 8 * last); r0 += 8) {
        const int64_t rows = std::min<int64_t>(8, m - r0);
        for (int64_t r = r0; r < r0 + rows; ++r) {
          int64_t i = 0;
          for (; i + kLanes <= k; i += kLanes) vstore(xf + r * k + i, load_bf16(xb + r * k + i));
          for (; i < k; ++i) xf[r * k + i] = infer::to_float(xp[r * k + i]);
        }
        for (int64_t g = 0; g < groups; ++g) {
          float t[8] = {};
          const float* xg = xf + r0 * k + g * group_size;
          if (rows == 8) {
            for (int64_t i = 0; i < group_size; ++i)
#pragma GCC unroll 8
              for (int l = 0; l < 8; ++l) t[l] += xg[l * k + i];
          } else {
            for (int l = 0; l < rows; ++l)
              for (int64_t i = 0; i < group_size; ++i) t[l] += xg[l * k + i];
          }
          for (int l = 0; l < rows; ++l) xsum[(r0 + l) * groups + g] = t[l];
        }
      }
    });
  }
  const Args a{xf, xsum, reinterpret_cast<const uint32_t*>(packed.data_ptr()),
               scales.data_ptr<float>(), off, b, reinterpret_cast<uint16_t*>(y.data_ptr()), m, n, k, groups,
               group_size / 8};
  if (widened)
    infer::for_blocks_and_rows(m, blocks, [&](int64_t blk, int64_t r0, int64_t r1) { rows_widened(a, blk, r0, r1); },
                               kWidenedRowChunk);
  else
    infer::for_blocks_and_rows(m, blocks, [&](int64_t blk, int64_t r0, int64_t r1) { rows(a, blk, r0, r1); });
  return y;
}

bool available() { return true; }
bool prompt_tiles(int64_t, int64_t) { return false; }

#else

torch::Tensor int4_linear(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>, int64_t,
                          c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "int4_linear: built for a CPU without AVX2 and FMA");
}

bool available() { return false; }
bool prompt_tiles(int64_t, int64_t) { return false; }

#endif

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernel alone
// compressed-tensors' stored 4-bit words ([N, K/8] int32, value i of a word at bits 4i, each u = q + 8) laid out as
// the kernel reads them ([ceil(N/32), K/8, 32], k = 8 kw + 2j at bits 4j and 8 kw + 2j + 1 at 16 + 4j; a padding
// column u = 8, q = 0, everywhere). One pass over the words: the same moves as torch ops took 32 passes, about
// 2 s for each layer of a 7B model at load.
torch::Tensor repack_words(torch::Tensor words, int64_t groups) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt && words.is_contiguous(),
              "repack_words: words must be a contiguous [N, K/8] int32 tensor");
  TORCH_CHECK(groups > 0 && words.size(1) % groups == 0, "repack_words: ", words.size(1), " words a row do not split into ",
              groups, " groups");
  const int64_t n = words.size(0), kw = words.size(1), blocks = (n + BLOCK_N - 1) / BLOCK_N, group_words = kw / groups;
  auto out = torch::empty({blocks, kw, BLOCK_N}, words.options());
  const auto* w = reinterpret_cast<const uint32_t*>(words.data_ptr());
  auto* o = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk)
      for (int64_t c = 0; c < BLOCK_N; ++c) {
        const int64_t col = blk * BLOCK_N + c;
        for (int64_t i = 0; i < kw; ++i) {
          uint32_t v = 0x88888888u;
          if (col < n) {
            const uint32_t s = w[col * kw + i];
            v = 0;
            for (int j = 0; j < 4; ++j)
              v |= ((s >> (8 * j)) & 0xFu) << (4 * j) | ((s >> (8 * j + 4)) & 0xFu) << (16 + 4 * j);
          }
          o[(blk * kw + stored_word(i, group_words, groups)) * BLOCK_N + c] = v;
        }
      }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("repack_words", &repack_words, "compressed-tensors' 4-bit words in this kernel's block layout",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_linear", &int4_linear, "int4 grouped-weight linear over a packed weight (CPU: AVX-512 BF16, AVX-512F or AVX2 + FMA)",
        py::call_guard<py::gil_scoped_release>());
  m.def("available", &available, "whether this build has the int4 kernel (its target has AVX2 + FMA at least)");
  m.def("prompt_tiles", &prompt_tiles, py::arg("k"), py::arg("group"),
        "whether a prompt chunk with K k in groups of `group` runs on AMX-BF16 tiles (tdpbf16ps) in this process");
}
#endif
