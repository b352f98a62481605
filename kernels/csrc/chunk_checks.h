// The checks every prompt-chunk attention kernel makes before it reads a row or a cache block
// (kernels/csrc/amx_attention.cpp, bf16_attention.cpp): one place for their shapes and messages.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace infer {

// q [T, heads, d] bfloat16 (rows may be strided, heads contiguous); k_cache, v_cache [blocks, block_size,
// kv_heads, d] (block_size == required_block unless that is 0); out contiguous, q's shape; chunk c has
// query rows starts[c] .. + lengths[c], follows cached[c] tokens, and reads its blocks from tables[c].
// Raises naming the first bad tensor, chunk or block id.
inline void check_chunk_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  const torch::Tensor& out, const torch::Tensor& starts, const torch::Tensor& lengths,
                                  const torch::Tensor& cached, const torch::Tensor& tables, int64_t required_block) {
  for (const auto& x : {q, k_cache, v_cache, out, starts, lengths, cached, tables})
    TORCH_CHECK(x.device().is_cpu(), "chunk_attention: CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "chunk_attention: bfloat16 only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "chunk_attention: q must be [T, heads, d]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "chunk_attention: out must be contiguous, q's shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == q.size(2) &&
                  (required_block == 0 || k_cache.size(1) == required_block),
              "chunk_attention: caches must be contiguous [blocks, ",
              required_block == 0 ? std::string("block_size") : std::to_string(required_block), ", kv_heads, d]");
  const int64_t d = q.size(2), heads = q.size(1), kv_heads = k_cache.size(2), block = k_cache.size(1);
  TORCH_CHECK(kv_heads > 0 && d > 0 && d % 32 == 0 && heads % kv_heads == 0,
              "chunk_attention: d must be a multiple of 32 and heads a multiple of kv_heads");
  for (const auto& x : {starts, lengths, cached, tables})
    TORCH_CHECK(x.scalar_type() == at::kLong && x.is_contiguous(), "chunk_attention: int64 contiguous indices");
  const int64_t chunks = starts.numel();
  TORCH_CHECK(starts.dim() == 1 && lengths.dim() == 1 && cached.dim() == 1 && lengths.numel() == chunks &&
                  cached.numel() == chunks && tables.dim() == 2 && tables.size(0) == chunks,
              "chunk_attention: starts, lengths and cached must be [chunks] and tables [chunks, width] for ", chunks,
              " chunks; got ", lengths.sizes(), ", ", cached.sizes(), " and ", tables.sizes());
  const int64_t width = tables.size(1);
  const int64_t *st = starts.data_ptr<int64_t>(), *ln = lengths.data_ptr<int64_t>(), *ca = cached.data_ptr<int64_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  for (int64_t c = 0; c < chunks; ++c) {  // every index checked before any is used
    TORCH_CHECK(ln[c] > 0 && st[c] >= 0 && st[c] + ln[c] <= q.size(0) && ca[c] >= 0 &&
                    (ca[c] + ln[c] + block - 1) / block <= width,
                "chunk_attention: chunk ", c, " (start ", st[c], ", length ", ln[c], ", cached ", ca[c],
                ") does not fit the ", q.size(0), " query rows or its block table of ", width, " blocks");
    for (int64_t b = 0; b < (ca[c] + ln[c] + block - 1) / block; ++b)
      TORCH_CHECK(tb[c * width + b] >= 0 && tb[c * width + b] < k_cache.size(0), "chunk_attention: block id ",
                  tb[c * width + b], " at tables[", c, "][", b, "] is outside the cache's ", k_cache.size(0), " blocks");
  }
}

}  // namespace infer
