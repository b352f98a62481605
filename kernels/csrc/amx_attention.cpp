// Attention of prompt chunks that follow cached tokens, on Intel AMX tiles, straight over the paged
// KV cache (bfloat16).
//
// A request whose system prompt is cached computes a short chunk (~30 tokens) that attends to the
// whole context (~430 tokens). torch's flash SDPA needs the context gathered and padded first, and
// spends ~0.3 ms a layer on such small shapes (a burst of 31 chunks: 11 ms a layer). Here one task
// per (chunk, 64 of its rows, KV head) takes those rows of the query heads sharing that KV head, and in two passes
// over the context computes scores S = Q K^T on tiles, a masked softmax per row in float32, and
// O = P V on tiles, normalising in float32 at the end. K and V are rearranged per task into the
// tile layout (dimension pairs, token pairs), reading the cache in place through the block table.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include "amx_tiles.h"
#include "call_buffer.h"
#include "chunk_checks.h"
#include "float_storage.h"
#include "simd_math.h"
#include "work_split.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using infer::kTileK;
using infer::kTileRows;
constexpr int64_t kBlock = 16;     // tokens per cache block: one B tile's columns
constexpr int64_t kJobRows = 64;   // chunk rows a task takes, for every query head of its KV head

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The tiles configured for a worker's tasks, released after its last
struct TileScope {
  TileScope() { infer::configure_tiles(); }
  TileScope(const TileScope&) = delete;
  ~TileScope() { _tile_release(); }
};

struct Task {
  const at::BFloat16* q;
  int64_t q_row, q_head;  // strides of q [T, heads, d]
  const at::BFloat16* k_cache;
  const at::BFloat16* v_cache;
  int64_t kv_heads, d;
  at::BFloat16* out;
  int64_t out_row, out_head;
  float scale;
};

// Chunk rows i0 .. i0 + m - 1 of a chunk for KV head h: rows r = g * m + i are query head h * group + g at chunk
// row i0 + i, which sees the keys up to cached + i0 + i. Each 16-row tile computes scores, probabilities and
// values only over the keys its last row sees (a causal prompt's tiles see a triangle, not the square).
// Its buffers are the worker's own (call_buffer), kept from one call to the next (they were allocated per task),
// left uninitialised: every element is written before it is read.
void chunk_rows(const Task& t, int64_t start, int64_t i0, int64_t m, int64_t cached, const int64_t* table, int64_t h,
                int64_t group) {
  const int64_t d = t.d, dk = d / kTileK, len = cached + i0 + m;
  const int64_t rows = group * m, rows_pad = round_up(rows, kTileRows);
  const int64_t keys16 = round_up(len, kBlock), keys32 = round_up(len, 2 * kBlock);
  const int64_t token_row = t.kv_heads * d;  // elements between consecutive tokens of a cache block
  // the keys row tile rt sees: up to its last row's, or all the job's where the tile spans two query heads
  const auto tile_keys = [&](int64_t rt) {
    const int64_t first = rt * kTileRows, last = std::min(rows, first + kTileRows) - 1;
    return cached + i0 + (first / m == last / m ? last % m : m - 1) + 1;
  };

  // Q as A tiles: [row tile][d / 32][16][32]
  at::BFloat16* qt = infer::call_buffer<at::BFloat16, 0>(rows_pad * d);
  for (int64_t r = 0; r < rows_pad; ++r) {
    at::BFloat16* dst = qt + (r / kTileRows) * dk * kTileRows * kTileK + (r % kTileRows) * kTileK;
    for (int64_t c = 0; c < dk; ++c, dst += kTileRows * kTileK) {
      if (r < rows) {
        const at::BFloat16* src = t.q + (start + i0 + r % m) * t.q_row + (h * group + r / m) * t.q_head + c * kTileK;
        std::memcpy(dst, src, kTileK * sizeof(at::BFloat16));
      } else {
        std::memset(dst, 0, kTileK * sizeof(at::BFloat16));
      }
    }
  }
  // K^T as B tiles, per block of 16 tokens and 32 dimensions: row p holds, for each token, the
  // pair of dimensions (2p, 2p + 1): the 32-bit words of the key rows, transposed.
  uint32_t* kt = infer::call_buffer<uint32_t>(keys16 / kBlock * dk * kTileRows * kBlock);
  for (int64_t b = 0; b < keys16 / kBlock; ++b) {
    const uint32_t* block = reinterpret_cast<const uint32_t*>(t.k_cache + (table[b] * kBlock * t.kv_heads + h) * d);
    for (int64_t c = 0; c < dk; ++c) {
      uint32_t* tile = kt + (b * dk + c) * kTileRows * kBlock;
      for (int64_t tok = 0; tok < kBlock; ++tok)
        for (int64_t p = 0; p < kTileRows; ++p) tile[p * kBlock + tok] = block[tok * token_row / 2 + c * kTileRows + p];
    }
  }
  // S = Q K^T, float32 [rows_pad][keys16], each row tile over the key blocks it sees
  float* s = infer::call_buffer<float, 0>(rows_pad * keys16);
  for (int64_t rt = 0; rt < rows_pad / kTileRows; ++rt)
    for (int64_t b = 0; b < round_up(tile_keys(rt), kBlock) / kBlock; ++b) {
      _tile_zero(0);
      for (int64_t c = 0; c < dk; ++c) {
        _tile_loadd(1, qt + (rt * dk + c) * kTileRows * kTileK, 64);
        _tile_loadd(2, kt + (b * dk + c) * kTileRows * kBlock, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, s + rt * kTileRows * keys16 + b * kBlock, keys16 * sizeof(float));
    }
  // softmax per row over the keys it may see (up to cached + i0 + i), as bfloat16 P [rows_pad][keys32],
  // unnormalised (exp(s - max) in [0, 1]), zero up to its tile's width; 1 / sum kept in float32 for the end
  at::BFloat16* pt = infer::call_buffer<at::BFloat16, 1>(rows_pad * keys32);
  float* inv_sum = infer::call_buffer<float, 1>(rows_pad);
  for (int64_t r = 0; r < rows; ++r)
    inv_sum[r] = infer::softmax_row_bf16(s + r * keys16, cached + i0 + r % m + 1,
                                         round_up(tile_keys(r / kTileRows), 2 * kBlock), t.scale,
                                         reinterpret_cast<uint16_t*>(pt + r * keys32));
  for (int64_t r = rows; r < rows_pad; ++r) std::memset(pt + r * keys32, 0, keys32 * sizeof(at::BFloat16));
  // V as B tiles, per 32 tokens and 16 dimensions: row p holds, for each dimension, tokens 2p and
  // 2p + 1. Tokens past the context are zero (their cache slots may hold anything).
  const int64_t dv = d / kTileRows;
  const int64_t v_values = keys32 / (2 * kBlock) * dv * kTileRows * 2 * kTileRows;
  at::BFloat16* vt = infer::call_buffer<at::BFloat16, 2>(v_values);
  const auto token_row_at = [&](int64_t tok) {
    return t.v_cache + ((table[tok / kBlock] * kBlock + tok % kBlock) * t.kv_heads + h) * d;
  };
  for (int64_t g = 0; g < keys32 / (2 * kBlock); ++g)
    for (int64_t p = 0; p < kTileRows; ++p) {
      const int64_t tok = g * 2 * kBlock + 2 * p;
      const at::BFloat16* r0 = tok < len ? token_row_at(tok) : nullptr;
      const at::BFloat16* r1 = tok + 1 < len ? token_row_at(tok + 1) : nullptr;
      for (int64_t c = 0; c < dv; ++c) {
        // 16 dimensions of two tokens as 16 words (token 2p low, 2p + 1 high): one tile row
        const __m512i lo = r0 != nullptr ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                               reinterpret_cast<const __m256i*>(r0 + c * kTileRows)))
                                         : _mm512_setzero_si512();
        const __m512i hi = r1 != nullptr ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                               reinterpret_cast<const __m256i*>(r1 + c * kTileRows)))
                                         : _mm512_setzero_si512();
        _mm512_storeu_si512(vt + (g * dv + c) * kTileRows * 2 * kTileRows + p * 2 * kTileRows,
                            _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  // O = P V, four 16-dimension column tiles at a time (tmm0-3; V in tmm5-7, the fourth in tmm5 again), each row
  // tile over the token pairs it sees; normalised and rounded at the end
  alignas(64) float o[kTileRows][4 * kTileRows];
  const auto v_tile = [&](int64_t g, int64_t c) { return vt + (g * dv + c) * kTileRows * 2 * kTileRows; };
  for (int64_t rt = 0; rt < rows_pad / kTileRows; ++rt)
    for (int64_t c0 = 0; c0 < dv; c0 += 4) {
      const int64_t cols = std::min<int64_t>(4, dv - c0);
      _tile_zero(0);  // tile numbers must be constants: all four, used or not
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t g = 0; g < round_up(tile_keys(rt), 2 * kBlock) / (2 * kBlock); ++g) {
        _tile_loadd(4, pt + rt * kTileRows * keys32 + g * 2 * kBlock, keys32 * sizeof(at::BFloat16));
        _tile_loadd(5, v_tile(g, c0), 64);
        _tile_dpbf16ps(0, 4, 5);
        if (cols > 1) {
          _tile_loadd(6, v_tile(g, c0 + 1), 64);
          _tile_dpbf16ps(1, 4, 6);
        }
        if (cols > 2) {
          _tile_loadd(7, v_tile(g, c0 + 2), 64);
          _tile_dpbf16ps(2, 4, 7);
        }
        if (cols > 3) {
          _tile_loadd(5, v_tile(g, c0 + 3), 64);
          _tile_dpbf16ps(3, 4, 5);
        }
      }
      _tile_stored(0, &o[0][0], sizeof(o[0]));
      if (cols > 1) _tile_stored(1, &o[0][kTileRows], sizeof(o[0]));
      if (cols > 2) _tile_stored(2, &o[0][2 * kTileRows], sizeof(o[0]));
      if (cols > 3) _tile_stored(3, &o[0][3 * kTileRows], sizeof(o[0]));
      for (int64_t x = 0; x < kTileRows; ++x) {
        const int64_t r = rt * kTileRows + x;
        if (r >= rows) break;
        at::BFloat16* dst =
            t.out + (start + i0 + r % m) * t.out_row + (h * group + r / m) * t.out_head + c0 * kTileRows;
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        for (int64_t y = 0; y < cols * kTileRows; y += kTileRows) {
          infer::store_bf16(dst + y, _mm512_mul_ps(_mm512_load_ps(&o[x][y]), inv));
        }
      }
    }
}

}  // namespace

// q [T, heads, d] bfloat16 (rows may be strided, heads contiguous); k_cache, v_cache [blocks, 16,
// kv_heads, d]; out [T, heads, d], written at the chunks' rows only. Chunk c has query rows
// starts[c] .. + lengths[c], follows cached[c] tokens, and reads its blocks from tables[c].
// Tasks: a chunk's kJobRows rows for one KV head (kernels/csrc/work_split.h).
void chunk_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor out,
                     torch::Tensor starts, torch::Tensor lengths, torch::Tensor cached, torch::Tensor tables,
                     double scale) {
  infer::check_chunk_attention(q, k_cache, v_cache, out, starts, lengths, cached, tables, kBlock);
  const int64_t d = q.size(2), heads = q.size(1), kv_heads = k_cache.size(2), chunks = starts.numel();
  const int64_t width = tables.size(1);
  const int64_t *st = starts.data_ptr<int64_t>(), *ln = lengths.data_ptr<int64_t>(), *ca = cached.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const Task task{q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1), k_cache.data_ptr<at::BFloat16>(),
                  v_cache.data_ptr<at::BFloat16>(), kv_heads, d, out.data_ptr<at::BFloat16>(), out.stride(0),
                  out.stride(1), static_cast<float>(scale)};
  infer::for_chunk_tasks(chunks, ln, ca, kv_heads, kJobRows, [] { return TileScope(); },
                         [&](TileScope&, int64_t c, int64_t h, int64_t i0, int64_t m) {
                           chunk_rows(task, st[c], i0, m, ca[c], tb + c * width, h, heads / kv_heads);
                         });
}

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernel alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable_amx", &infer::enable_amx, "request AMX tile permission for this process");
  m.def("chunk_attention", &chunk_attention, "attention of prompt chunks after cached tokens on AMX tiles (CPU)");
}
#endif
