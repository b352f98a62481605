// bfloat16 linear layers (y = x W^T + b) on Intel AMX tiles, for the few-row matmuls of serving.
//
// A decode step or a short prompt chunk multiplies a handful of rows by every weight of the
// model: the work is reading the weights, and the best kernel is the one that streams them at
// memory speed. oneDNN's blocked matmul reaches about a third of this machine's read bandwidth
// at 1-32 rows. Here the weights are stored once in AMX's tile layout (kernels/amx_linear.py
// packs them), each thread streams its own column blocks front to back, and the rows of x stay
// in cache. Products of bfloat16 pairs accumulate in float32 tiles; the output is rounded to
// bfloat16 once, with the bias added in float32 first, as oneDNN does; the LM head keeps its float32 sums
// (float_out: logits are not rounded to bfloat16, bf16_linear.cpp says why).
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "amx_tiles.h"
#include "call_buffer.h"
#include "float_storage.h"

#include <cstdint>
#include <cstring>

namespace {

using infer::configure_tiles;
using infer::kBlockN;
using infer::kTileK;
using infer::kTileRows;
constexpr int64_t kPrefetchTiles = 4;  // how far ahead of its loads a thread prefetches weights
constexpr int64_t kRowBlockBytes = 512 << 10;  // rows of x worked on together: kept in L2

// One group's products: rows (<= 32) of x, read as A tiles from xa (lda bytes apart, readable for 32 rows), times
// 32 columns' weights (w0, w1: two columns tiles' [K/32][16][32] blocks), left in the C tiles. tmm0-3 accumulate C
// (2 row tiles x 2 column tiles), tmm4-5 hold rows of x, tmm6-7 hold weights. prefetch: ask for the weights ahead
// of their loads (they come from memory the first time a thread reads them, from cache after).
void pair_products(const at::BFloat16* xa, int64_t lda, bool two, int64_t kblocks, const at::BFloat16* w0,
                   const at::BFloat16* w1, bool prefetch) {
  infer::zero_accumulators(two);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    if (prefetch) {
      const char* ahead0 = reinterpret_cast<const char*>(w0 + (kb + kPrefetchTiles) * kTileRows * kTileK);
      const char* ahead1 = reinterpret_cast<const char*>(w1 + (kb + kPrefetchTiles) * kTileRows * kTileK);
      for (int line = 0; line < 1024; line += 64) {
        _mm_prefetch(ahead0 + line, _MM_HINT_T0);
        _mm_prefetch(ahead1 + line, _MM_HINT_T0);
      }
    }
    infer::tile_step<false>(xa + kb * kTileK, lda, w0 + kb * kTileRows * kTileK, w1 + kb * kTileRows * kTileK, 64, two);
  }
}

using GroupSums = float[2 * kTileRows][2 * kBlockN];

// out[m0 .. m0 + rows - 1, n0 .. n0 + 31] from a group's sums: bias in float32, then one rounding to bfloat16 (round
// to nearest even) per 32 outputs; float32 sums where float_out
void pair_out(const GroupSums& c, int64_t m0, int64_t rows, int64_t n0, const at::BFloat16* bias, void* out,
              int64_t out_stride, bool float_out) {
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0))), 16));
    b1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + n0 + kBlockN))), 16));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_load_ps(&c[r][0]), b0), hi = _mm512_add_ps(_mm512_load_ps(&c[r][kBlockN]), b1);
    if (float_out) {
      float* y = static_cast<float*>(out) + (m0 + r) * out_stride + n0;
      _mm512_storeu_ps(y, lo);
      _mm512_storeu_ps(y + kBlockN, hi);
    } else {
      _mm512_storeu_si512(static_cast<at::BFloat16*>(out) + (m0 + r) * out_stride + n0,
                          (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

}  // namespace

// x: [M, K] bfloat16, any strides; w_blocks: the weight as packed by kernels/amx_linear.py,
// [N / 16, K / 32, 16, 32] bfloat16; bias: [N] bfloat16 or None. Returns [M, N] bfloat16 (float32 where float_out).
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor w_blocks, c10::optional<torch::Tensor> bias,
                         bool float_out = false) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_linear: x must be a [M, K] bfloat16 tensor");
  TORCH_CHECK(w_blocks.dim() == 4 && w_blocks.is_contiguous() && w_blocks.scalar_type() == at::kBFloat16 &&
                  w_blocks.size(2) == kTileRows && w_blocks.size(3) == kTileK,
              "amx_linear: weights must be packed by kernels/amx_linear.py");
  const int64_t M = x.size(0), K = x.size(1), N = w_blocks.size(0) * kBlockN;
  TORCH_CHECK(w_blocks.size(1) * kTileK == K, "amx_linear: x has ", K, " features, the weights expect ",
              w_blocks.size(1) * kTileK);
  TORCH_CHECK(N % (2 * kBlockN) == 0, "amx_linear: the output size must be a multiple of 32");
  const at::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N && bias->scalar_type() == at::kBFloat16,
                "amx_linear: bias must be a contiguous bfloat16 [N] tensor");
    b = bias->data_ptr<at::BFloat16>();
  }
  // A tiles are read straight from x's rows where each tile row (32 values, 64 bytes) lies on a cache line (a
  // split row loads at a third of the speed: bench/amx_tiles.py); the rows past the last whole 32, and every row of
  // an x that is not so laid out, are copied first into rows that are, padded with zero rows to a multiple of 32.
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  const int64_t row_stride = x.stride(0), col_stride = x.stride(1);
  const bool in_place = col_stride == 1 && reinterpret_cast<std::uintptr_t>(xs) % 64 == 0 && row_stride * 2 % 64 == 0;
  const int64_t direct = in_place ? M / (2 * kTileRows) * (2 * kTileRows) : 0;  // rows read in place
  const int64_t copied = (M - direct + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
  at::BFloat16* xc = infer::align_up(infer::call_buffer<at::BFloat16>(copied * K + 32), 64);
  at::parallel_for(0, copied, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      at::BFloat16* dst = xc + r * K;
      const int64_t src_row = direct + r;
      if (src_row >= M) {
        std::memset(dst, 0, K * sizeof(at::BFloat16));
      } else if (col_stride == 1) {
        std::memcpy(dst, xs + src_row * row_stride, K * sizeof(at::BFloat16));
      } else {
        for (int64_t i = 0; i < K; ++i) dst[i] = xs[src_row * row_stride + i * col_stride];
      }
    }
  });
  auto out = torch::empty({M, N}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  const at::BFloat16* w = w_blocks.data_ptr<at::BFloat16>();
  void* o = out.data_ptr();
  // Each task: a run of 32-column pairs. Rows go in blocks of about kRowBlockBytes of x, so that
  // a block stays in the core's L2 while the task's weights stream past it; a few rows (serving's
  // usual case) are one block, and the weights are read exactly once.
  const int64_t rows_per_block = std::max<int64_t>(2 * kTileRows, kRowBlockBytes / (2 * K) / (2 * kTileRows) * (2 * kTileRows));
  const int64_t kblocks = K / kTileK;
  // rows m0 .. m1 of 32 columns from n0, a group of 32 rows at a time; each group's outputs are written while the
  // tiles work on the next (written after their own products, they took a third of a 256 x 576 x 3072 call)
  auto column_pair_rows = [&](int64_t m0, int64_t m1, int64_t n0) {
    const at::BFloat16* w0 = w + (n0 / kBlockN) * kblocks * kTileRows * kTileK;
    const at::BFloat16* w1 = w0 + kblocks * kTileRows * kTileK;
    alignas(64) GroupSums c[2];
    int64_t g = 0, last = 0;
    for (int64_t r = m0; r < m1; r += 2 * kTileRows, ++g) {
      const int64_t rows = std::min<int64_t>(m1 - r, 2 * kTileRows);
      const bool here = r < direct;
      pair_products(here ? xs + r * row_stride : xc + (r - direct) * K, here ? row_stride * 2 : K * 2,
                    rows > kTileRows, kblocks, w0, w1, r == m0);
      if (g > 0) pair_out(c[(g - 1) & 1], last, 2 * kTileRows, n0, b, o, N, float_out);
      infer::store_accumulators(c[g & 1], rows > kTileRows);
      last = r;
    }
    if (g > 0) pair_out(c[(g - 1) & 1], last, m1 - last, n0, b, o, N, float_out);
  };
  at::parallel_for(0, N / (2 * kBlockN), 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    for (int64_t block = 0; block < M; block += rows_per_block)
      for (int64_t p = begin; p < end; ++p)
        column_pair_rows(block, std::min(M, block + rows_per_block), p * 2 * kBlockN);
    _tile_release();
  });
  return out;
}

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernel alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable_amx", &infer::enable_amx, "request AMX tile permission for this process");
  m.def("amx_linear", &amx_linear, "bfloat16 x @ W^T + b on AMX tiles (weights packed by amx_linear.py); float_out: float32 sums",
        py::arg("x"), py::arg("w_blocks"), py::arg("bias"), py::arg("float_out") = false);
}
#endif
