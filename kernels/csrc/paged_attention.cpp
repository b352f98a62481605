// Decode attention straight over the paged KV cache, on the CPU.
//
// One task per (sequence, KV head): the query heads that share that KV head are scored against
// every cached token, read in place through the block table (no gather, no padding), then
// softmax and the weighted sum of V, accumulated in float32 whatever the cache dtype.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}


#if defined(__AVX512F__)
// 16 lanes of a row in float32, whatever the storage type.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Scores of `group` query rows (float32, head_dim floats each) against one K row.
template <typename T>
inline void score_row(const float* q, const T* k, float* out, int64_t group, int64_t head_dim, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * head_dim + d), load16(k + d), acc);
    out[g * stride] = _mm512_reduce_add_ps(acc);
  }
}

// acc[g] += p[g] * v for `group` accumulator rows.
template <typename T>
inline void accumulate_row(const float* p, int64_t p_stride, const T* v, float* acc, int64_t group, int64_t head_dim) {
  for (int64_t d = 0; d < head_dim; d += 16) {
    const __m512 vv = load16(v + d);
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * head_dim + d;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(p[g * p_stride]), vv, _mm512_loadu_ps(a)));
    }
  }
}
#endif

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, T* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                   float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;    // between tokens of a block
  const int64_t block_stride = block_size * token_stride;  // between blocks
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), row(head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads;
      const int64_t len = context_lens[s];
      const int64_t* table = block_tables + s * max_blocks;
      for (int64_t g = 0; g < group; ++g)
        load_row(q + (s * num_heads + kvh * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
      scores.assign(group * len, 0.f);
#if defined(__AVX512F__)
      if (head_dim % 16 == 0) {
        for (int64_t t = 0; t < len; ++t) {
          const T* k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * head_dim;
          score_row(qf.data(), k, scores.data() + t, group, head_dim, len);
        }
        for (int64_t i = 0; i < group * len; ++i) scores[i] *= scale;
      } else
#endif
      for (int64_t t = 0; t < len; ++t) {
        const T* k = k_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * head_dim;
        load_row(k, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
          scores[g * len + t] = dot * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        float mx = sg[0];  // len >= 1; no infinities under -ffast-math
        for (int64_t t = 1; t < len; ++t) mx = std::max(mx, sg[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX512F__)
      if (head_dim % 16 == 0) {
        for (int64_t t = 0; t < len; ++t) {
          const T* v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * head_dim;
          accumulate_row(scores.data() + t, len, v, acc.data(), group, head_dim);
        }
      } else
#endif
      for (int64_t t = 0; t < len; ++t) {
        const T* v = v_cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * head_dim;
        load_row(v, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (s * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

}  // namespace

// q: [seqs, heads, head_dim]; k_cache, v_cache: [blocks, block_size, kv_heads, head_dim];
// block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64. Returns [seqs, heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "head layout mismatch");
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                            block_tables.size(1), static_cast<float>(scale));
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16 only");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
}
