// bfloat16 linears on AVX-512 BF16 (vdpbf16ps), for CPUs that have those instructions but no AMX.
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
// Sums are float32 (bf16 products are exact in float32), the bias is added in float32, and each
// output is rounded once to bfloat16 (nearest even), as oneDNN and torch's bf16 linears do; the
// order of the additions differs, so results agree to bfloat16 rounding, not bit for bit.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "simd_math.h"
#include "work_split.h"

#include <cstdint>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

// How far ahead of its loads a tile prefetches its block: the hardware prefetcher alone kept a batch-1 sweep
// of the embedded model's 121 linears at 0.70 of a `sum`'s read bandwidth on a 2-core Xeon with AMX; 512 B ahead
// gave 0.83, 1 KiB 0.86, 2 KiB 0.91, 4 KiB 0.86 (2 threads, rounds alternated).
constexpr int64_t kPrefetchBytes = 2048;

inline __m256i to_bf16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(infer::bf16_round_bits(v), 16));
}

// y[0:ROWS, n0:n0+16*LANES] = x[0:ROWS] . block + bias, for one block of 16*LANES columns.
template <int ROWS, int LANES>
inline void tile(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* block, const float* bias,
                 uint16_t* y, int64_t ldy, int64_t n0, int64_t n) {
  __m512 acc[ROWS][LANES];
  for (int j = 0; j < LANES; ++j) {
    const int64_t col = n0 + 16 * j;
    const __mmask16 live = col >= n ? 0 : col + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - col)) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(live, bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) acc[r][j] = b;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* w = block + p * LANES * 32;
    for (int j = 0; j < LANES; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + 32 * j) + kPrefetchBytes, _MM_HINT_T0);
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
      const int64_t col = n0 + 16 * j;
      if (col + 16 <= n)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + col), to_bf16(acc[r][j]));
      else if (col < n)
        _mm256_mask_storeu_epi16(y + r * ldy + col, static_cast<__mmask16>((1u << (n - col)) - 1), to_bf16(acc[r][j]));
    }
}

// Every row of x against one block, in tiles of as many rows as the registers hold.
template <int LANES>
inline void rows_of_block(const uint16_t* x, int64_t ldx, int64_t pairs, const uint16_t* block, const float* bias,
                          uint16_t* y, int64_t n0, int64_t n, int64_t r, int64_t r1) {
  constexpr int WIDE = 24 / LANES;  // 24 accumulators (of 32 registers)
  for (; r + WIDE <= r1; r += WIDE) tile<WIDE, LANES>(x + r * ldx, ldx, pairs, block, bias, y + r * n, n, n0, n);
  for (; r + 4 <= r1; r += 4) tile<4, LANES>(x + r * ldx, ldx, pairs, block, bias, y + r * n, n, n0, n);
  for (; r + 2 <= r1; r += 2) tile<2, LANES>(x + r * ldx, ldx, pairs, block, bias, y + r * n, n, n0, n);
  for (; r < r1; ++r) tile<1, LANES>(x + r * ldx, ldx, pairs, block, bias, y + r * n, n, n0, n);
}

}  // namespace

// x: [M, K] bfloat16 with contiguous rows; packed: [ceil(N/W), K/2, W, 2] with W 64 or 32 (kernels/bf16_linear.py);
// bias: float32 [N] or None. Returns [M, N] bfloat16.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n, c10::optional<torch::Tensor> bias) {
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
  auto y = torch::empty({m, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t ldx = x.stride(0), block_elems = pairs * width * 2;
  infer::for_blocks_and_rows(m, blocks, [&](int64_t blk, int64_t r, int64_t r1) {
    const uint16_t* w = wp + blk * block_elems;
    if (width == 64)
      rows_of_block<4>(xp, ldx, pairs, w, b, yp, blk * width, n, r, r1);
    else
      rows_of_block<2>(xp, ldx, pairs, w, b, yp, blk * width, n, r, r1);
  });
  return y;
}

bool available() { return true; }

#else

torch::Tensor bf16_linear(torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "bf16_linear: built for a CPU without AVX-512 BF16");
}

bool available() { return false; }

#endif

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernels alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as torch's own ops run: a prompt chunk's matmul must not stall a server's event loop
  m.def("bf16_linear", &bf16_linear, "bfloat16 linear on AVX-512 BF16 over a packed weight (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("available", &available, "whether this build has the AVX-512 BF16 kernel");
}
#endif
