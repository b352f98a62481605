// bfloat16 linears on the CPU: AVX-512 BF16 (vdpbf16ps) where the CPU has it, else bfloat16 widened to
// float32 in registers and multiplied with FMA (AVX-512F or AVX2 + FMA): one source, the instruction set
// chosen by the build's target flags (kernels/isa.py compiles one build per CPU class).
//
// A decode step multiplies one row (or a few) by every weight of the model: the weights stream
// from memory once per step, and how close a step comes to the memory-bandwidth floor is how
// steadily they stream. The weight is stored once, at load, as one sequential stream per block
// of W = 64 output columns (32 for a narrow weight): [N/W][K/2][W][2], each k pair of the block's
// columns side by side, the pair layout vdpbf16ps multiplies against a broadcast pair of x. A tile
// of rows x block columns reads its block front to back and keeps every partial sum in registers,
// lanes = output columns, so there is no horizontal reduction; more rows reuse each weight load
// (24 accumulators: 6 rows of 64 columns, 12 of 32), which is what makes the same layout fast for
// prompt chunks too. Narrow weights get narrow blocks so that a decode step's few blocks split
// evenly over the threads (576 columns: 9 blocks of 64 leave one thread 5 and the other 4).
//
// Without vdpbf16ps the same layout serves: a 32-bit word of it holds one column's (k, k+1) pair, so a
// vector of words widens to the k row (x << 16) and the k+1 row (x & 0xffff0000) of as many columns,
// each multiplied by a broadcast x[k] or x[k+1] with FMA. The weights stay 16-bit in memory, so decode
// keeps bfloat16's bandwidth advantage over a float32 model.
//
// Sums are float32 (bf16 products are exact in float32), the bias is added in float32, and each
// output is rounded once to bfloat16 (nearest even), as oneDNN and torch's bf16 linears do; the
// order of the additions differs, so results agree to bfloat16 rounding, not bit for bit. The LM head asks for its
// sums unrounded (float32 out): rounding logits to bfloat16 (a step of 0.125 at 20) set the floor of every
// comparison between two runs (int8 KV against bfloat16: mean KLD 0.0021 with rounded logits, 0.0012 without).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "call_buffer.h"
#include "float_storage.h"
#include "prefetch.h"
#include "simd_math.h"
#include "work_split.h"

#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// What both instruction-set paths below check before reading anything: the shapes and dtypes
// kernels/bf16_linear.py packs; the bias's data, or nullptr.
struct Bf16Inputs {
  int64_t m, k, pairs, blocks, width;
  const float* bias;
};
inline Bf16Inputs check_bf16_inputs(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                    const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "bf16_linear: x must be a [M, K] bfloat16 tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  (packed.size(2) == 64 || packed.size(2) == 32) && packed.size(3) == 2,
              "bf16_linear: the weight must be packed by kernels/bf16_linear.py");
  const int64_t m = x.size(0), k = x.size(1), pairs = packed.size(1), blocks = packed.size(0), width = packed.size(2);
  TORCH_CHECK(k == 2 * pairs, "bf16_linear: x has ", k, " features, the packed weight ", 2 * pairs);
  TORCH_CHECK(n > (blocks - 1) * width && n <= blocks * width, "bf16_linear: ", n,
              " output features do not match the packed weight's ", blocks, " blocks");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "bf16_linear: bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  return {m, k, pairs, blocks, width, b};
}

}  // namespace

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

// y[0:ROWS, 16*J0 .. 16*(J0+LANES) of the block's columns] = x[0:ROWS] . those columns + bias: LANES of the
// VECS vectors of 16 columns a pair row of the block holds (all of them, or half of a 64-column block).
template <int ROWS, int LANES, int VECS = LANES, typename Out>
inline void tile(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* block, const float* bias,
                 Out* y, int64_t ldy, int64_t n0, int64_t n, int J0 = 0) {
  __m512 acc[ROWS][LANES];
  for (int j = 0; j < LANES; ++j) {
    const int64_t col = n0 + 16 * (J0 + j);
    const __mmask16 live = col >= n ? 0 : col + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(live, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) acc[r][j] = b;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = block + p * VECS * 32 + 32 * J0;
    // the first of two half tiles prefetches whole pair rows: the second then reads its half from cache (left to
    // the hardware, reading half of every 256-byte row ran a 7-9 row LM head 1.3x slower than three tiles)
    for (int j = 0; j < (J0 == 0 ? VECS : LANES); ++j)
      infer::prefetch_ahead<infer::kPlainPrefetchBytes>(w + 32 * j);
    __m512bh wv[LANES];
    for (int j = 0; j < LANES; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < LANES; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < LANES; ++j) {
      const int64_t col = n0 + 16 * (J0 + j);
      if (col >= n) continue;
      const __mmask16 live = col + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
      if constexpr (std::is_same_v<Out, float>)
        _mm512_mask_storeu_ps(y + r * ldy + col, live, acc[r][j]);
      else
        _mm256_mask_storeu_epi16(y + r * ldy + col, live, infer::to_bf16(acc[r][j]));
    }
}

// rows (1 to 12) of x against the whole block in one pass over its weights: a tile of all of them where their
// sums fit (rows x VECS <= 24), else (a 64-column block, 7 to 12 rows) two tiles of half its columns, each reading
// half of every pair row. Rows in tiles of 6, 4, 2 and 1 read the block once a tile: a decode step verifying 8
// draft tokens (9 rows: 6 + 2 + 1) took 2.3x a one-row step's time in the gate_up linear, 4 rows 1.0x.
template <int VECS, int ROWS = 1, typename Out>
inline void one_pass(int rows, const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* block, const float* bias,
                     Out* y, int64_t ldy, int64_t n0, int64_t n) {
  if constexpr (ROWS <= 12) {
    if (rows != ROWS)
      return one_pass<VECS, ROWS + 1>(rows, x, ldx, pairs, block, bias, y, ldy, n0, n);
    if constexpr (ROWS * VECS <= 24) {
      tile<ROWS, VECS, VECS>(x, ldx, pairs, block, bias, y, ldy, n0, n);
    } else {
      static_assert(VECS == 4, "blocks are 64 or 32 columns");
      tile<ROWS, 2, 4>(x, ldx, pairs, block, bias, y, ldy, n0, n, 0);
      tile<ROWS, 2, 4>(x, ldx, pairs, block, bias, y, ldy, n0, n, 2);
    }
  }
}

// Every row of x against one block: tiles of as many rows as the registers hold, the rest in one pass.
template <int LANES, typename Out>
inline void rows_of_block(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* block, const float* bias,
                          Out* y, int64_t n0, int64_t n, int64_t r, int64_t r1) {
  constexpr int WIDE = 24 / LANES;  // 24 accumulators (of 32 registers)
  for (; r1 - r > 12; r += WIDE) tile<WIDE, LANES, LANES>(x + r * ldx, ldx, pairs, block, bias, y + r * n, n, n0, n);
  if (r < r1) one_pass<LANES>(static_cast<int>(r1 - r), x + r * ldx, ldx, pairs, block, bias, y + r * n, n, n0, n);
}

}  // namespace

// y = x W^T + bias over every block and row (y: bfloat16 bits or float32 sums)
template <typename Out>
void run_blocks(const Bf16Inputs& in, const torch::Tensor& x, const torch::Tensor& packed, int64_t n, Out* yp) {
  const int64_t m = in.m, pairs = in.pairs, blocks = in.blocks, width = in.width;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t ldx = x.stride(0), block_elems = pairs * width * 2;
  infer::for_blocks_and_rows(m, blocks, [&](int64_t blk, int64_t r, int64_t r1) {
    const uint16_t* w = wp + blk * block_elems;
    if (width == 64)
      rows_of_block<4>(xp, ldx, pairs, w, in.bias, yp, blk * width, n, r, r1);
    else
      rows_of_block<2>(xp, ldx, pairs, w, in.bias, yp, blk * width, n, r, r1);
  });
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {


// The vector of this build: 16 float32 lanes with AVX-512F, 8 with AVX2.
#if defined(__AVX512F__)
using vf = __m512;
constexpr int kLanes = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
// one column pair word a lane: the k rows (low halves) and the k+1 rows (high halves), widened to float32
inline void widen_pairs(const uint16_t* w, vf& even, vf& odd) {
  const __m512i raw = _mm512_loadu_si512(w);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#else
using vf = __m256;
constexpr int kLanes = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void widen_pairs(const uint16_t* w, vf& even, vf& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif

// The bias of a vector of columns from col (zero past n, or without a bias): where a tile's sums start.
inline vf bias_vector(const float* bias, int64_t col, int64_t n) {
  alignas(64) float b[kLanes] = {};
  for (int i = 0; i < kLanes; ++i)
    if (bias != nullptr && col + i < n) b[i] = bias[col + i];
  return vload(b);
}

// A vector of sums into y[0 ..] for the columns from col before n: rounded once to bfloat16 (nearest even), or as
// they are (float32 out). A whole vector is rounded in registers (one value at a time, the rounding took 5-9% of a
// 256-token prompt's linears on the FMA classes); a NaN stays a NaN there, its payload in the high half as every NaN
// of sums of bfloat16 products has it.
template <typename Out>
inline void store_sums(Out* y, vf v, int64_t col, int64_t n) {
  if (col + kLanes <= n) {
    if constexpr (std::is_same_v<Out, float>) vstore(y, v);
    else infer::store_bf16(y, v);
    return;
  }
  alignas(64) float out[kLanes];
  vstore(out, v);
  for (int i = 0; col + i < n; ++i) {
    if constexpr (std::is_same_v<Out, float>) y[i] = out[i];
    else y[i] = infer::from_float<at::BFloat16>(out[i]).x;
  }
}

// y[0:ROWS, c0:c0+V*kLanes] = x[0:ROWS] . block columns c0.. + bias; x in float32 (xf, K floats a row),
// the block `width` columns wide, its first column n0 of the n outputs.
template <int ROWS, int V, typename Out>
inline void tile(const float* xf, int64_t k, int64_t pairs, const uint16_t* block, int64_t width, int64_t c0,
                 const float* bias, Out* y, int64_t ldy, int64_t n0, int64_t n) {
  vf acc[ROWS][V];
  for (int j = 0; j < V; ++j) {
    const vf b = bias_vector(bias, n0 + c0 + j * kLanes, n);
    for (int r = 0; r < ROWS; ++r) acc[r][j] = b;
  }
  const uint16_t* w = block + 2 * c0;
  const int64_t step = 2 * width;  // uint16 a pair row
  // the first slice of a block prefetches whole pair rows (the other slices then read theirs from cache)
  const int64_t ahead = c0 == 0 ? 4 * width : V * kLanes * 4;  // bytes of the pair row this tile prefetches
  for (int64_t p = 0; p < pairs; ++p, w += step) {
    for (int64_t b = 0; b < ahead; b += 64)
      infer::prefetch_ahead<infer::kPlainPrefetchBytes>(reinterpret_cast<const char*>(w) + b);
    for (int j = 0; j < V; ++j) {
      vf even, odd;
      widen_pairs(w + 2 * kLanes * j, even, odd);
      for (int r = 0; r < ROWS; ++r) {
        acc[r][j] = vfma(vbroadcast(xf + r * k + 2 * p), even, acc[r][j]);
        acc[r][j] = vfma(vbroadcast(xf + r * k + 2 * p + 1), odd, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < V; ++j) {
      const int64_t col = n0 + c0 + j * kLanes;
      store_sums(y + r * ldy + col, acc[r][j], col, n);
    }
}

constexpr int kTileRows = kLanes == 16 ? 8 : 4;  // a tile's rows: 2 x rows accumulators, of 32 or 16 registers

// A prompt chunk's rows (a work item of kWideItemRows) against one block: the block widened once to float32
// ([K][width], in the thread's buffer), then tiles that do nothing but FMA, ROWS rows x VS vectors of columns
// (AVX-512: 6 x 64 or 12 x 32 columns, 24 sums; AVX2: 6 x 16, 12 sums), each k one load per vector and one
// broadcast per row. Widening each pair word inside the tiles (a shift and a mask per vector and k pair, for
// every tile of rows) held the avx512 class's 256-token prefill to 48% of its FMA peak.
constexpr int64_t kWideMinRows = 16;    // a work item's rows from which its block is widened first
constexpr int64_t kWideItemRows = 256;  // rows a work item of a prompt chunk (the block widened once for them)

template <int ROWS, int VS, typename Out>
inline void wide_tile(const float* xf, int64_t k, const float* wf, int64_t width, int64_t c0, const float* bias,
                      Out* y, int64_t ldy, int64_t n0, int64_t n) {
  vf acc[ROWS][VS];
  for (int j = 0; j < VS; ++j) {
    const vf b = bias_vector(bias, n0 + c0 + j * kLanes, n);
    for (int r = 0; r < ROWS; ++r) acc[r][j] = b;
  }
  const float* w = wf + c0;
  for (int64_t i = 0; i < k; ++i, w += width) {
    vf wv[VS];
    for (int j = 0; j < VS; ++j) wv[j] = vload(w + j * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const vf xb = vbroadcast(xf + r * k + i);
      for (int j = 0; j < VS; ++j) acc[r][j] = vfma(xb, wv[j], acc[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < VS; ++j) {
      const int64_t col = n0 + c0 + j * kLanes;
      store_sums(y + r * ldy + col, acc[r][j], col, n);
    }
}

// rows r .. r1 (at least kWideMinRows) of x against one block, widened first
template <int V, typename Out>  // V: vectors a block row
inline void wide_rows_of_block(const float* xf, int64_t k, int64_t pairs, const uint16_t* block, const float* bias,
                               Out* y, int64_t n0, int64_t n, int64_t r, int64_t r1) {
  constexpr int64_t width = V * kLanes;
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>(2 * pairs * width));
  float* wf = buffer.data();
  for (int64_t p = 0; p < pairs; ++p)
    for (int j = 0; j < V; ++j) {
      vf even, odd;
      widen_pairs(block + p * 2 * width + 2 * kLanes * j, even, odd);
      vstore(wf + (2 * p) * width + j * kLanes, even);
      vstore(wf + (2 * p + 1) * width + j * kLanes, odd);
    }
  constexpr int VS = kLanes == 16 ? V : 2;                     // vectors a tile: the whole block on AVX-512
  constexpr int ROWS = kLanes == 16 ? 24 / VS : 6;             // 24 sums of 32 registers; 12 of 16
  for (int64_t c0 = 0; c0 < width; c0 += VS * kLanes) {
    int64_t i = r;
    for (; i + ROWS <= r1; i += ROWS) wide_tile<ROWS, VS>(xf + i * k, k, wf, width, c0, bias, y + i * n, n, n0, n);
    for (; i + 2 <= r1; i += 2) wide_tile<2, VS>(xf + i * k, k, wf, width, c0, bias, y + i * n, n, n0, n);
    for (; i < r1; ++i) wide_tile<1, VS>(xf + i * k, k, wf, width, c0, bias, y + i * n, n, n0, n);
  }
}

// rows (fewer than kTileRows) of x against the whole block in one pass: a slice tile of all of them per 2 vectors
// of columns
template <int V, int ROWS = 2, typename Out>  // V: vectors a block row
inline void slices(int rows, const float* xf, int64_t k, int64_t pairs, const uint16_t* block, const float* bias,
                   Out* y, int64_t n0, int64_t n) {
  if constexpr (ROWS < kTileRows) {
    if (rows != ROWS) return slices<V, ROWS + 1>(rows, xf, k, pairs, block, bias, y, n0, n);
    for (int64_t c0 = 0; c0 < V * kLanes; c0 += 2 * kLanes)
      tile<ROWS, 2>(xf, k, pairs, block, V * kLanes, c0, bias, y, n, n0, n);
  }
}

// Every row of x against one block. One row (a decode step at batch 1) reads each pair row of the block whole,
// front to back; a few go in one pass of slice tiles (2 vectors of columns, all the rows: a tile a row re-read
// the block, and 2-7 rows on AVX-512 ran 1.1-2.1x slower so, `python -m infer.bench.linear_rows`); more go in
// tiles of kTileRows x 2 vectors, which keep every weight load for kTileRows rows.
template <int V, typename Out>  // vectors a block row: width / kLanes
inline void rows_of_block(const float* xf, int64_t k, int64_t pairs, const uint16_t* block, const float* bias,
                          Out* y, int64_t n0, int64_t n, int64_t r, int64_t r1) {
  constexpr int64_t width = V * kLanes;
  // from this many rows on, slice tiles: 2 rows of 8-lane AVX2 ran 1.1-1.15x slower as slices than as 2 passes
  constexpr int kSliceRows = kLanes == 16 ? 2 : 3;
  if (r1 - r < kSliceRows) {
    for (; r < r1; ++r) tile<1, V>(xf + r * k, k, pairs, block, width, 0, bias, y + r * n, n, n0, n);
    return;
  }
  if (r1 - r < kTileRows) {  // a few rows (decode rows, verify rows): one pass
    slices<V>(static_cast<int>(r1 - r), xf + r * k, k, pairs, block, bias, y + r * n, n0, n);
    return;
  }
  if (r1 - r >= kWideMinRows) {  // a prompt chunk's rows: the block widened once
    wide_rows_of_block<V>(xf, k, pairs, block, bias, y, n0, n, r, r1);
    return;
  }
  for (int64_t c0 = 0; c0 < width; c0 += 2 * kLanes) {
    int64_t i = r;
    for (; i + kTileRows <= r1; i += kTileRows)
      tile<kTileRows, 2>(xf + i * k, k, pairs, block, width, c0, bias, y + i * n, n, n0, n);
    for (; i + 2 <= r1; i += 2) tile<2, 2>(xf + i * k, k, pairs, block, width, c0, bias, y + i * n, n, n0, n);
    for (; i < r1; ++i) tile<1, 2>(xf + i * k, k, pairs, block, width, c0, bias, y + i * n, n, n0, n);
  }
}

}  // namespace

template <typename Out>
void run_blocks(const Bf16Inputs& in, const torch::Tensor& x, const torch::Tensor& packed, int64_t n, Out* yp) {
  const int64_t m = in.m, k = in.k, pairs = in.pairs, blocks = in.blocks, width = in.width;
  const float* b = in.bias;
  // x widened once (exact), so that the tiles broadcast float32 straight from memory (a plain loop: a torch
  // op's dispatch would cost a decode step's small linears a good share of their time), a prompt chunk's rows over
  // the threads
  float* xf = infer::call_buffer<float>(m * k);
  const auto* xb = reinterpret_cast<const at::BFloat16*>(x.data_ptr());
  auto widen = [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t i = 0; i < k; ++i) xf[r * k + i] = infer::to_float(xb[r * x.stride(0) + i]);
  };
  if (m >= infer::kDynamicRows)
    at::parallel_for(0, m, 1, widen);
  else
    widen(0, m);
  const float* xp = xf;
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t block_elems = pairs * width * 2;
  infer::for_blocks_and_rows(m, blocks, [&](int64_t blk, int64_t r, int64_t r1) {
    const uint16_t* w = wp + blk * block_elems;
    if (width == 64)
      rows_of_block<64 / kLanes>(xp, k, pairs, w, b, yp, blk * width, n, r, r1);
    else
      rows_of_block<32 / kLanes>(xp, k, pairs, w, b, yp, blk * width, n, r, r1);
  }, m >= kWideMinRows ? kWideItemRows : infer::kRowChunk);
}

#endif

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
// x: [M, K] bfloat16 with contiguous rows; packed: [ceil(N/W), K/2, W, 2] with W 64 or 32 (kernels/bf16_linear.py);
// bias: float32 [N] or None. Returns [M, N] bfloat16, or float32 sums unrounded where float_out (run_blocks: the
// instruction set's path above).
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias,
                          bool float_out = false) {
  const Bf16Inputs in = check_bf16_inputs(x, packed, n, bias);
  auto y = torch::empty({in.m, n}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (float_out)
    run_blocks(in, x, packed, n, y.data_ptr<float>());
  else
    run_blocks(in, x, packed, n, reinterpret_cast<uint16_t*>(y.data_ptr()));
  return y;
}

bool available() { return true; }

#else

torch::Tensor bf16_linear(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>, bool = false) {
  TORCH_CHECK(false, "bf16_linear: built for a CPU without AVX2 and FMA");
}

bool available() { return false; }

#endif

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernels alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as torch's own ops run: a prompt chunk's matmul must not stall a server's event loop
  m.def("bf16_linear", &bf16_linear,
        "bfloat16 linear over a packed weight (CPU: AVX-512 BF16, AVX-512F or AVX2 + FMA); float_out: float32 sums",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"), py::arg("float_out") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("available", &available, "whether this build has a bfloat16 linear (its target has AVX2 + FMA at least)");
}
#endif
