// Decode attention straight over the paged KV cache, on the CPU.
//
// One task per (sequence, KV head): the query heads that share that KV head are scored against
// every cached token, read in place through the block table (no gather, no padding), then
// softmax and the weighted sum of V, accumulated in float32 whatever the cache dtype.
//
// A bfloat16 cache on AVX-512 BF16 (head_dim a multiple of 32) takes bf16_task: q . k by vdpbf16ps
// (bfloat16 products are exact in float32, so this is the float path's arithmetic in another
// order), 16 tokens' scores reduced together rather than one horizontal sum a token, V widened
// two lanes per instruction, and token rows found by walking the block table rather than a
// division a token; each task in 128-token spans the threads take as work items, merged by their largest
// scores (decode_bf16). The tasks and their spans are a function of their own sequence alone: a row gets the
// same bits in any batch.
//
// Other caches, and CPUs without AVX-512 BF16, take fixed_task for the common shapes: queries and
// accumulators in registers, the cache widened to float32 as it is read (a bfloat16 row's even and odd values
// apart, the queries and accumulators in that order), scores reduced 16 (AVX-512F) or 8 (AVX2) tokens together,
// rows found by walking the block table; other shapes take the general loops.
//
// An int8 cache (the quantized KV cache, runtime/engine/attention.py) is [blocks, kv_heads, block_size,
// head_dim + 2], head-major so that a task's rows lie back to back (kernels/cpu_attention.block_shape):
// each (token, KV head) row is head_dim int8 values (a key's turned by a Walsh-Hadamard
// transform, hadamard_block below) then the 2 bytes of its bfloat16 scale
// (symmetric: absmax / 127, rounded to bfloat16 first and the values quantized against the rounded
// scale, so value x scale is the dequantized value exactly). store_kv_ quantizes as it stores; the decode
// tasks read the int8 values in registers and apply a key's scale to its score and a value's scale to its
// probability: one multiply a token, never a dequantized copy of the cache. q8i_task sums in integers
// (int16 queries and probabilities against the int8 rows by vpmaddwd, on 256-bit vectors in every class):
// the path that makes the int8 cache faster than the bfloat16 one. Widening the values to float32 instead
// (the task AVX-512 builds took before) cost what the bfloat16 cache's loops do, so it gained nothing from
// reading half the bytes: on a Zen 5 at 2k context, 1.05x / 1.23x the bfloat16 cache's kernel (batch 1 /
// 16) and a decode step at batch 16 0.91x, against 3.2x / 2.9x and 1.79x with q8i_task (0.89x / 0.95x /
// 0.85x against 1.93x / 2.02x / 1.40x with the class forced to avx512).
//
// Blocks lie anywhere in the pool, so the hardware prefetcher loses the stream at every block's start, and a
// bfloat16 task reads a third of each token's row (its KV head's) with the other heads' between: the tasks ask
// for rows ahead as they read, into L2 (prefetcht1): bf16_task 48 rows on, the others a block or two
// (prefetch_row). Into L1 instead (prefetcht0), or left to the hardware, bf16_task read a cold cache at half
// the rate (Zen 5, 2 threads, 64 sequences: 10-13 GB/s, against 21-25 with a sum of the same caches at 26-31).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "float_storage.h"
#include "simd_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using infer::to_float;
#if defined(__AVX512F__)
using infer::exp16;
#endif

// One row of scores to probabilities in place, in plain C++: the general loops' softmax (the vector paths
// have their own softmax_inplace). len >= 1.
inline void softmax_row(float* s, int64_t len) {
  float mx = s[0];
  for (int64_t t = 1; t < len; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

// Attention logit soft-capping (Gemma 2): each score becomes tanh(score / cap) * cap, after the scale and
// before the softmax, as transformers computes it. cap 0: none (the scores are left untouched).
inline void cap_scores(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < n; ++i) s[i] = std::tanh(s[i] / cap) * cap;
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// The scale of an int8 cache row: the bfloat16 in the 2 bytes after its head_dim values.
inline float q8_scale(const int8_t* row, int64_t head_dim) {
  at::BFloat16 s;
  std::memcpy(&s.x, row + head_dim, sizeof(s.x));
  return to_float(s);
}

// Keys are stored turned by a Walsh-Hadamard transform over blocks of hadamard_block(head_dim) dims (the
// largest power of two dividing it), unnormalized: k' = H k. A few channels of a key are often several
// times the rest, and one scale per row spends its 127 steps on them; turned, every channel carries a
// share of each, the row's absmax falls toward its RMS and the small channels keep their precision
// (SmolLM2-135M over 2,048-token windows: mean KLD of int8 keys against float32 0.00083 plain, 0.00023
// turned). Queries are turned the same way and divided by the block (H H = block I), so q'.k' = q.k:
// the decode kernel turns each query once, its loops over the cache are unchanged. Values are stored
// plain (their int8 error was already 20x below the keys').
inline int64_t hadamard_block(int64_t head_dim) { return head_dim & -head_dim; }

// x <- H x, H the unnormalized Walsh-Hadamard matrix of size n (a power of two), in n log2(n) adds.
inline void hadamard_(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

// hadamard_ over each block of a head's head_dim values.
inline void hadamard_head_(float* x, int64_t head_dim) {
  const int64_t n = hadamard_block(head_dim);
  for (int64_t b = 0; b < head_dim; b += n) hadamard_(x + b, n);
}

// The int8 cache's layout, [blocks, kv_heads, block_size, head_dim + 2], as byte strides: a head's rows of
// a block lie back to back (kernels/cpu_attention.block_shape says why).
struct Q8Layout {
  int64_t row, head, block;  // a token's row, a KV head's rows of a block, a block
  Q8Layout(int64_t kv_heads, int64_t block_size, int64_t head_dim)
      : row(head_dim + 2), head(block_size * (head_dim + 2)), block(kv_heads * block_size * (head_dim + 2)) {}
};

// Quantizes n floats into an int8 cache row (n values, then the bfloat16 scale): the scale is absmax /
// 127 rounded to bfloat16, the values round(x / scale) clamped to +-127, so |x - value * scale| <= scale / 2.
template <typename T>
inline void q8_store_row(const T* src, int8_t* dst, int64_t n) {
  float absmax = 0.f;
  for (int64_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(to_float(src[i])));
  const at::BFloat16 scale = infer::from_float<at::BFloat16>(absmax / 127.f);
  const float s = to_float(scale), inv = s > 0.f ? 1.f / s : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint(to_float(src[i]) * inv);
    dst[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  std::memcpy(dst + n, &scale.x, sizeof(scale.x));
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


// x[i] = exp(x[i] - max x) in place over n >= 1 floats; returns {max x, the sum of the exps}.
inline std::pair<float, float> exp_shifted(float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(x[0]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  if (i < n) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, x + i));
  const float top = _mm512_reduce_max_ps(mx);
  const __m512 m = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, x + i), m)));
    _mm512_mask_storeu_ps(x + i, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  return {top, _mm512_reduce_add_ps(sum)};
}

// In-place softmax of n floats.
inline void softmax_inplace(float* x, int64_t n) {
  const __m512 inv = _mm512_set1_ps(1.0f / exp_shifted(x, n).second);
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), inv));
  if (i < n) _mm512_mask_storeu_ps(x + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, x + i), inv));
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

#endif  // __AVX512F__

#if defined(__AVX512F__) || defined(__AVX2__)
// The vector fixed_task works in: 16 float32 lanes with AVX-512F (the same instructions as written out
// above), 8 with AVX2.
#if defined(__AVX512F__)
using vecf = __m512;
constexpr int kVec = 16;
inline vecf vload(const float* p) { return _mm512_loadu_ps(p); }
template <typename T>
inline vecf vload_row(const T* p) { return load16(p); }
inline vecf vzero() { return _mm512_setzero_ps(); }
inline vecf vset1(float x) { return _mm512_set1_ps(x); }
inline vecf vmul(vecf a, vecf b) { return _mm512_mul_ps(a, b); }
inline vecf vfma(vecf a, vecf b, vecf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vecf a) { return _mm512_reduce_add_ps(a); }
inline void vstore(float* p, vecf a) { _mm512_storeu_ps(p, a); }
#else
using vecf = __m256;
constexpr int kVec = 8;
inline vecf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vecf vload_row(const float* p) { return _mm256_loadu_ps(p); }
inline vecf vload_row(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vecf vload_row(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vecf vzero() { return _mm256_setzero_ps(); }
inline vecf vset1(float x) { return _mm256_set1_ps(x); }
inline vecf vmul(vecf a, vecf b) { return _mm256_mul_ps(a, b); }
inline vecf vfma(vecf a, vecf b, vecf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vecf a) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline void vstore(float* p, vecf a) { _mm256_storeu_ps(p, a); }

// In-place softmax of n floats (8 lanes; the tail scalar, with the same exponential). The maximum in
// vectors: a scalar compare-and-select loop is one dependent chain (GCC vectorizes it only under
// -ffast-math), about a tenth of a 2k-token task.
inline void softmax_inplace(float* x, int64_t n) {
  __m256 vmx = _mm256_set1_ps(x[0]);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmx), _mm256_extractf128_ps(vmx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  for (; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = infer::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) {
    alignas(32) float tail[8] = {};
    for (int64_t j = i; j < n; ++j) tail[j - i] = x[j] - mx;
    alignas(32) float e[8];
    _mm256_store_ps(e, infer::exp8(_mm256_load_ps(tail)));
    for (int64_t j = i; j < n; ++j) x[j] = e[j - i];
    for (int64_t j = n - i; j < 8; ++j) e[j] = 0.f;
    sum = _mm256_add_ps(sum, _mm256_load_ps(e));
  }
  const __m256 inv = _mm256_set1_ps(1.0f / vsum(sum));
  for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
  for (; i < n; ++i) x[i] *= _mm256_cvtss_f32(inv);
}
#endif

// softmax_inplace over a row's visible scores: the first `skip` (tokens of the window's first block that
// fall before a sliding window) get probability 0.
inline void softmax_visible(float* s, int64_t len, int64_t skip) {
  softmax_inplace(s + skip, len - skip);
  std::fill(s, s + skip, 0.f);
}

// Prefetches the cache lines that n values from `row` touch (rows ahead of the loop: the top of the file).
template <typename T>
inline void prefetch_row(const T* row, int64_t n) {
  const auto first = reinterpret_cast<uintptr_t>(row) & ~uintptr_t{63};
  const auto last = reinterpret_cast<uintptr_t>(row + n) - 1;
  for (uintptr_t line = first; line <= last; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), _MM_HINT_T1);
}

// How far ahead fixed_task asks for rows: the same token of the block this many blocks on (into L2; one block
// read a cold cache 0.94x as fast on Zen 5 forced to avx512)
constexpr int64_t kAheadBlocks = 2;

// Lane i of the result: the sum of v[i]'s lanes, for kVec vectors at once (a transpose-and-add tree: 46 shuffles and
// adds for 16 vectors where 16 horizontal sums take ~140; fixed_task's and bf16_task's scores)
#if defined(__AVX512F__)
inline vecf sum_lanes(const vecf* v) {
  __m512 c[8], d[4];
  for (int j = 0; j < 8; ++j)  // halves: c[j] = [v[2j] folded to 8 | v[2j+1] folded to 8]
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * j], v[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // quarters: quarter q of d[j] = v[4j + q] folded to 4
    d[j] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD));
  const __m512 e0 = _mm512_add_ps(_mm512_unpacklo_ps(d[0], d[1]), _mm512_unpackhi_ps(d[0], d[1]));
  const __m512 e1 = _mm512_add_ps(_mm512_unpacklo_ps(d[2], d[3]), _mm512_unpackhi_ps(d[2], d[3]));
  const __m512 f = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(e0), _mm512_castps_pd(e1))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(e0), _mm512_castps_pd(e1))));
  // lane 4q + j of f holds v[4j + q]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}
#else
inline vecf sum_lanes(const vecf* v) {
  const __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // [v0..v3 low | v0..v3 high] sums
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}
#endif

// Walks a sequence's token rows for one KV head through its block table from a given token (the token-major cache:
// a token's row every token_stride values, its head's at offset): one lookup a block, no division a token.
template <typename T>
struct TokenRows {
  const T* cache;
  const int64_t* table;
  int64_t block_size, block_stride, token_stride, offset;
  int64_t block, in_block;
  const T* at(int64_t b, int64_t i) const { return cache + table[b] * block_stride + i * token_stride + offset; }
  const T* next() {
    const T* row = at(block, in_block);
    if (++in_block == block_size) in_block = 0, ++block;
    return row;
  }
};

// TokenRows from a sequence's first token, each row asking for the same token's row kAheadBlocks blocks on (its
// head's n values; see the top of the file) while that lies within the len tokens.
template <typename T>
struct CacheRows {
  TokenRows<T> rows;
  int64_t len, n;
  const T* next() {
    if ((rows.block + kAheadBlocks) * rows.block_size + rows.in_block < len)
      prefetch_row(rows.at(rows.block + kAheadBlocks, rows.in_block), n);
    return rows.next();
  }
};

// The dim that position i of a split row holds: per 2 kVec dims, the even ones, then the odd ones
inline int split_dim(int i) {
  const int base = i / (2 * kVec) * (2 * kVec), j = i % (2 * kVec);
  return base + (j < kVec ? 2 * j : 2 * (j - kVec) + 1);
}

// D vectors of a row: as they lie, or (split, bfloat16) per 2 kVec values their even values then their odd ones
template <bool split, int D, typename T>
inline void load_rows(const T* p, vecf* out) {
  if constexpr (split) {
    for (int d = 0; d < D; d += 2) {
#if defined(__AVX512F__)
      const __m512i raw = _mm512_loadu_si512(p + d * kVec);
      out[d] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      out[d + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + d * kVec));
      out[d] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      out[d + 1] = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
    }
  } else {
    for (int d = 0; d < D; ++d) out[d] = vload_row(p + d * kVec);
  }
}

// One (sequence, KV head) task with the head count per KV head (G) and head_dim / kVec (D) known at
// compile time, so the queries and the output accumulators live in registers for the whole task. Token rows are
// found by walking the block table (one lookup a block, no division a token), and kVec tokens' scores are reduced
// together (sum_lanes) rather than one horizontal sum a score. With bfloat16 rows split (load_rows), the three
// took a bfloat16 cache's 30 layers at 64 sequences x 257 tokens from 26.7 to 24.7 ms and one layer repeated (from
// L3) from 0.54 to 0.43 ms (Xeon, `amx` class, 2 threads, medians of 5 interleaved rounds).
template <typename T, int G, int D>
void fixed_task(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table, int64_t len,
                int64_t skip, int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t kv_offset, float* scores,
                float* acc_out, float softcap) {
  // bfloat16 rows read 2 kVec values a load, split into their even and odd values (a shift and a mask, where
  // widening kVec values takes a cross-lane instruction): the queries and accumulators in that order too
  constexpr bool split = std::is_same_v<T, at::BFloat16> && D % 2 == 0;
  vecf q[G][D];
  for (int g = 0; g < G; ++g) {
    alignas(64) float row[D * kVec];
    for (int i = 0; i < D * kVec; ++i) row[i] = qf[g * D * kVec + (split ? split_dim(i) : i)];
    for (int d = 0; d < D; ++d) q[g][d] = vload(row + d * kVec);
  }
  vecf part[G][kVec];  // the current kVec tokens' products, a vector a (head, token), summed together
  CacheRows<T> keys{{k_cache, table, block_size, block_stride, token_stride, kv_offset, 0, 0}, len, D * kVec};
  for (int64_t t = 0; t < len; ++t) {
    vecf kr[D];
    load_rows<split, D>(keys.next(), kr);
    const int j = static_cast<int>(t & (kVec - 1));
    for (int g = 0; g < G; ++g) {
      vecf a = vmul(q[g][0], kr[0]);
      for (int d = 1; d < D; ++d) a = vfma(q[g][d], kr[d], a);
      part[g][j] = a;
    }
    if (j == kVec - 1)
      for (int g = 0; g < G; ++g) vstore(scores + g * len + t + 1 - kVec, sum_lanes(part[g]));
  }
  for (int64_t u = len / kVec * kVec; u < len; ++u)
    for (int g = 0; g < G; ++g) scores[g * len + u] = vsum(part[g][u & (kVec - 1)]);
  cap_scores(scores, G * len, softcap);
  for (int g = 0; g < G; ++g) softmax_visible(scores + g * len, len, skip);
  vecf acc[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) acc[g][d] = vzero();
  CacheRows<T> values{{v_cache, table, block_size, block_stride, token_stride, kv_offset, 0, 0}, len, D * kVec};
  for (int64_t t = 0; t < len; ++t) {
    vecf vr[D];
    load_rows<split, D>(values.next(), vr);
    for (int g = 0; g < G; ++g) {
      const vecf p = vset1(scores[g * len + t]);
      for (int d = 0; d < D; ++d) acc[g][d] = vfma(p, vr[d], acc[g][d]);
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float row[D * kVec];
    for (int d = 0; d < D; ++d) vstore(row + d * kVec, acc[g][d]);
    for (int i = 0; i < D * kVec; ++i) acc_out[g * D * kVec + (split ? split_dim(i) : i)] = row[i];
  }
}
#endif

#if defined(__AVX2__)
// A sequence's int8 cache rows for one KV head in order, walking its block table: one lookup a block, no
// division a token. A head's rows of a block lie back to back (head-major); entering a block prefetches the
// same head's rows `ahead` blocks on (see the top of the file).
struct Q8Rows {
  const int8_t* cache;
  const int64_t* table;
  int64_t len, block_size, block_stride, token_stride, offset;
  int64_t ahead;  // blocks: far enough that the rows have arrived when the loop reaches them (0: no prefetch)
  int64_t block = 0, in_block = 0;
  const int8_t* next() {
    if (in_block == 0 && ahead > 0 && (block + ahead) * block_size < len)
      prefetch_row(cache + table[block + ahead] * block_stride + offset, block_size * token_stride);
    const int8_t* row = cache + table[block] * block_stride + in_block * token_stride + offset;
    if (++in_block == block_size) in_block = 0, ++block;
    return row;
  }
};

// Lane i of the result: the sum of v[i]'s 8 int32 lanes (six pairwise adds and a swap of halves, where 8
// horizontal sums take ~40 instructions).
inline __m256i sum_lanes8(const __m256i* v) {
  const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);  // [v0..v3 low | v0..v3 high]
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

// The int8 cache's task: integer scores and int16 weights for V (head_dim a multiple of 16), where float
// loops would cost what the bfloat16 cache's do (widening int8 to float32 takes as many instructions as
// bfloat16) and so gain nothing from reading half the bytes.
// Scores: each query row rounded to int16 against its own scale (absmax / 32767, 1.5e-5 of its largest
// value, far below the keys' int8 step), q.k summed exactly in int32 by vpmaddwd over the keys widened to
// int16 (|sum| <= head_dim * 128 * 32767 < 2^31 for head_dim <= 512), 8 tokens' sums reduced together.
// V: per span of 64 tokens, each probability times its value's scale rounded to int16 against the span's
// largest (an error of at most 1 / 65534 of it a token), two tokens' values interleaved so one vpmaddwd
// sums both into int32 (|sum| <= 64 * 128 * 32767 < 2^31 a span), flushed to float32 accumulators once a span.
template <int G, int HD>
void q8i_task(const float* qf, const int8_t* k_cache, const int8_t* v_cache, const int64_t* table, int64_t len,
              int64_t skip, int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t kv_offset,
              float* scores, float* acc_out, float softcap) {
  static_assert(HD % 16 == 0 && HD <= 512, "int16 chunks of 16 dims; int32 sums bounded");
  constexpr int C = HD / 16;
  __m256i q16[G][C];
  float qs[G];
  for (int g = 0; g < G; ++g) {
    float amax = 0.f;
    for (int d = 0; d < HD; ++d) amax = std::max(amax, std::fabs(qf[g * HD + d]));
    qs[g] = amax / 32767.f;
    const float inv = amax > 0.f ? 32767.f / amax : 0.f;
    alignas(32) int16_t row[HD];
    for (int d = 0; d < HD; ++d)
      row[d] = static_cast<int16_t>(std::min(32767.f, std::max(-32767.f, std::nearbyint(qf[g * HD + d] * inv))));
    for (int c = 0; c < C; ++c) q16[g][c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(row + 16 * c));
  }
  Q8Rows keys{k_cache, table, len, block_size, block_stride, token_stride, kv_offset, 2};
  for (int64_t t0 = 0; t0 < len; t0 += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, len - t0));
    __m256i part[G][8];
    alignas(32) float ks[8] = {};
    for (int i = 0; i < 8; ++i) {
      if (i >= n) {
        for (int g = 0; g < G; ++g) part[g][i] = _mm256_setzero_si256();
        continue;
      }
      const int8_t* k = keys.next();
      ks[i] = q8_scale(k, HD);
      __m256i kr[C];
      for (int c = 0; c < C; ++c)
        kr[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + 16 * c)));
      for (int g = 0; g < G; ++g) {
        __m256i a = _mm256_madd_epi16(kr[0], q16[g][0]);
        for (int c = 1; c < C; ++c) a = _mm256_add_epi32(a, _mm256_madd_epi16(kr[c], q16[g][c]));
        part[g][i] = a;
      }
    }
    const __m256 kscale = _mm256_load_ps(ks);
    for (int g = 0; g < G; ++g) {
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(sum_lanes8(part[g])), _mm256_mul_ps(kscale, _mm256_set1_ps(qs[g])));
      if (n == 8) {
        _mm256_storeu_ps(scores + g * len + t0, s);
      } else {
        alignas(32) float out[8];
        _mm256_store_ps(out, s);
        for (int i = 0; i < n; ++i) scores[g * len + t0 + i] = out[i];
      }
    }
  }
  cap_scores(scores, G * len, softcap);
  for (int g = 0; g < G; ++g) softmax_visible(scores + g * len, len, skip);

  constexpr int64_t kSpan = 64;
  float acc[G][HD] = {};
  // the rows of a span are read back to back before its sums: prefetch past the span
  Q8Rows values{v_cache, table, len, block_size, block_stride, token_stride, kv_offset,
                (kSpan + block_size - 1) / block_size + 1};
  for (int64_t t0 = 0; t0 < len; t0 += kSpan) {
    const int64_t n = std::min<int64_t>(kSpan, len - t0);
    const int8_t* rows[kSpan];
    alignas(32) float vs[kSpan];
    for (int64_t i = 0; i < n; ++i) {
      rows[i] = values.next();
      vs[i] = q8_scale(rows[i], HD);
    }
    for (int64_t i = n; i < kSpan; ++i) rows[i] = rows[n - 1], vs[i] = 0.f;  // padding, at weight 0
    // (w[2j], w[2j + 1]) as two int16 in one int32 lane: the pair one vpmaddwd takes
    alignas(32) int16_t p16[G][kSpan];
    float ws[G];
    for (int g = 0; g < G; ++g) {
      alignas(32) float w[kSpan];
      const float* sg = scores + g * len + t0;
      __m256 wmax = _mm256_setzero_ps();
      for (int64_t i = 0; i < kSpan; i += 8) {
        __m256 x;
        if (i + 8 <= n) {
          x = _mm256_loadu_ps(sg + i);
        } else {
          alignas(32) float tail[8] = {};
          for (int64_t k = i; k < n; ++k) tail[k - i] = sg[k];
          x = _mm256_load_ps(tail);
        }
        x = _mm256_mul_ps(x, _mm256_load_ps(vs + i));
        _mm256_store_ps(w + i, x);
        wmax = _mm256_max_ps(wmax, x);  // probabilities and scales are >= 0
      }
      alignas(32) float m8[8];
      _mm256_store_ps(m8, wmax);
      const float m = *std::max_element(m8, m8 + 8);
      ws[g] = m / 32767.f;
      const __m256 inv = _mm256_set1_ps(m > 0.f ? 32767.f / m : 0.f);
      for (int64_t i = 0; i < kSpan; i += 16) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(w + i), inv));
        const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(w + i + 8), inv));
        _mm256_store_si256(reinterpret_cast<__m256i*>(p16[g] + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
      }
    }
    const int64_t pairs = (n + 1) / 2;
    for (int c = 0; c < C; ++c) {  // 16 dims at a time: G x 2 int32 accumulators in registers
      __m256i lo[G], hi[G];
      for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
      for (int64_t j = 0; j < pairs; ++j) {
        const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * j] + 16 * c)));
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[2 * j + 1] + 16 * c)));
        const __m256i ab_lo = _mm256_unpacklo_epi16(a, b), ab_hi = _mm256_unpackhi_epi16(a, b);  // dims 0-3, 8-11 | 4-7, 12-15
        for (int g = 0; g < G; ++g) {
          int32_t pair;
          std::memcpy(&pair, p16[g] + 2 * j, sizeof(pair));
          const __m256i p = _mm256_set1_epi32(pair);
          lo[g] = _mm256_add_epi32(lo[g], _mm256_madd_epi16(ab_lo, p));
          hi[g] = _mm256_add_epi32(hi[g], _mm256_madd_epi16(ab_hi, p));
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m256 s = _mm256_set1_ps(ws[g]);
        const __m256 d0 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo[g], hi[g], 0x20));  // dims 0-7
        const __m256 d1 = _mm256_cvtepi32_ps(_mm256_permute2x128_si256(lo[g], hi[g], 0x31));  // dims 8-15
        float* a = acc[g] + 16 * c;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(d0, s, _mm256_loadu_ps(a)));
        _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(d1, s, _mm256_loadu_ps(a + 8)));
      }
    }
  }
  for (int g = 0; g < G; ++g) std::copy(acc[g], acc[g] + HD, acc_out + g * HD);
}
#endif

#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
// One (sequence, KV head) task on a bfloat16 cache, over the sequence's tokens t0 .. t1 (of its visible context,
// counted from its table's first block; tokens before `skip` lie before a sliding window): G query heads,
// head_dim = 32 * KD. q rows are bfloat16 (the model's own values, unscaled: the scale multiplies the scores).
// Writes, per query head, the span's largest score to top[g], the sum of exp(score - top) to total[g] and the sum
// of exp(score - top) v, head_dim float32, to acc_out (a span with no visible token: -inf, 0, zeros), so spans of
// one task merge into its softmax-weighted sum (merge_spans).
template <int G, int KD>
void bf16_task(const uint16_t* const* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
               int64_t t0, int64_t t1, int64_t skip, int64_t block_size, int64_t block_stride, int64_t token_stride,
               int64_t kv_offset, float scale, float* scores, float* acc_out, float* top, float* total, float softcap) {
  const int64_t len = t1 - t0, hidden = std::min(len, std::max<int64_t>(0, skip - t0));
  __m512bh qv[G][KD];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < KD; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q[g] + 32 * c);
  const __m512 sc = _mm512_set1_ps(scale);
  TokenRows<uint16_t> keys{k_cache, table, block_size, block_stride, token_stride, kv_offset, t0 / block_size,
                          t0 % block_size};
  // the span's rows, keys then values, asked for kAheadRows ahead of their use: a head's 64 * KD bytes of a
  // token lie between the other heads' (token_stride apart), which the hardware's prefetchers follow too slowly
  TokenRows<uint16_t> ahead_k = keys, ahead_v{v_cache, table, block_size, block_stride, token_stride, kv_offset,
                                    t0 / block_size, t0 % block_size};
  int64_t asked = 0;  // rows asked for so far, of the span's 2 * len
  const auto ask = [&](int64_t upto) {
    for (upto = std::min(upto, 2 * len); asked < upto; ++asked)
      prefetch_row(asked < len ? ahead_k.next() : ahead_v.next(), 32 * KD);
  };
  constexpr int64_t kAheadRows = 48;
  for (int64_t i0 = 0; i0 < len; i0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - i0);
    ask(i0 + 16 + kAheadRows);
    const uint16_t* rows[16];
    for (int64_t i = 0; i < n; ++i) rows[i] = keys.next();
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int i = 0; i < 16; ++i) {
        acc[i] = _mm512_setzero_ps();
        if (i < n)
          for (int c = 0; c < KD; ++c)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(rows[i] + 32 * c), qv[g][c]);
      }
      _mm512_mask_storeu_ps(scores + g * len + i0, valid, _mm512_mul_ps(sum_lanes(acc), sc));
    }
  }
  cap_scores(scores, G * len, softcap);
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * len;
    std::fill(sg, sg + hidden, 0.f);
    if (hidden == len) {
      top[g] = -std::numeric_limits<float>::infinity(), total[g] = 0.f;
    } else {
      std::tie(top[g], total[g]) = exp_shifted(sg + hidden, len - hidden);
    }
  }
  // a raw 32-lane bfloat16 vector widens to its even lanes (x << 16) and its odd ones (x & 0xffff0000):
  // acc[g][2c] holds dims 32c, 32c + 2, ..., acc[g][2c + 1] dims 32c + 1, 32c + 3, ...
  __m512 acc[G][2 * KD];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 2 * KD; ++c) acc[g][c] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  TokenRows<uint16_t> values{v_cache, table, block_size, block_stride, token_stride, kv_offset, t0 / block_size,
                            t0 % block_size};
  for (int64_t t = 0; t < len; ++t) {
    if (t % 8 == 0) ask(len + t + 8 + kAheadRows);
    const uint16_t* row = values.next();
    __m512 vr[2 * KD];
    for (int c = 0; c < KD; ++c) {
      const __m512i raw = _mm512_loadu_si512(row + 32 * c);
      vr[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      vr[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t]);
      for (int c = 0; c < 2 * KD; ++c) acc[g][c] = _mm512_fmadd_ps(p, vr[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < KD; ++c) {
      alignas(64) float even[16], odd[16];
      _mm512_store_ps(even, acc[g][2 * c]);
      _mm512_store_ps(odd, acc[g][2 * c + 1]);
      float* o = acc_out + g * 32 * KD + 32 * c;
      for (int i = 0; i < 16; ++i) o[2 * i] = even[i], o[2 * i + 1] = odd[i];
    }
}

using Bf16Task = void (*)(const uint16_t* const*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*, float*, float*, float);

// The bfloat16 task for this shape, or nullptr (the float path then runs).
inline Bf16Task pick_bf16_task(int64_t group, int64_t head_dim) {
#define INFER_CASE(G, KD) if (group == G && head_dim == 32 * KD) return &bf16_task<G, KD>;
  INFER_CASE(1, 1) INFER_CASE(2, 1) INFER_CASE(3, 1) INFER_CASE(4, 1) INFER_CASE(1, 2) INFER_CASE(2, 2)
  INFER_CASE(3, 2) INFER_CASE(4, 2) INFER_CASE(5, 2) INFER_CASE(6, 2) INFER_CASE(7, 2) INFER_CASE(8, 2)
  INFER_CASE(1, 4) INFER_CASE(2, 4) INFER_CASE(4, 4) INFER_CASE(7, 4) INFER_CASE(8, 4)
#undef INFER_CASE
  return nullptr;
}
#endif
#endif  // __AVX512F__

#if defined(__AVX512F__) || defined(__AVX2__)
using FixedTask = void (*)(const float*, const void*, const void*, const int64_t*, int64_t, int64_t, int64_t,
                           int64_t, int64_t, int64_t, float*, float*, float);

template <typename T, int G, int D>
void fixed_task_erased(const float* qf, const void* k, const void* v, const int64_t* table, int64_t len,
                       int64_t skip, int64_t bs, int64_t block_stride, int64_t token_stride, int64_t off, float* scores,
                       float* acc, float softcap) {
  fixed_task<T, G, D>(qf, static_cast<const T*>(k), static_cast<const T*>(v), table, len, skip, bs, block_stride,
                      token_stride, off, scores, acc, softcap);
}

// The specialised task for this shape, or nullptr for the general path.
template <typename T>
FixedTask pick_fixed_task(int64_t group, int64_t head_dim) {
#define INFER_CASE(G, HD) if (group == G && head_dim == HD) return &fixed_task_erased<T, G, HD / kVec>;
  INFER_CASE(1, 64) INFER_CASE(2, 64) INFER_CASE(3, 64) INFER_CASE(4, 64) INFER_CASE(5, 64) INFER_CASE(6, 64)
  INFER_CASE(7, 64) INFER_CASE(8, 64) INFER_CASE(1, 128) INFER_CASE(2, 128) INFER_CASE(4, 128) INFER_CASE(7, 128)
  INFER_CASE(8, 128)
#undef INFER_CASE
  return nullptr;
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
using Q8Task = void (*)(const float*, const int8_t*, const int8_t*, const int64_t*, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float*, float*, float);

// The int8 task for this shape, or nullptr for the general loops.
inline Q8Task pick_q8_task(int64_t group, int64_t head_dim) {
#define INFER_CASE(G, HD) if (group == G && head_dim == HD) return &q8i_task<G, HD>;
  INFER_CASE(1, 64) INFER_CASE(2, 64) INFER_CASE(3, 64) INFER_CASE(4, 64) INFER_CASE(5, 64) INFER_CASE(6, 64)
  INFER_CASE(7, 64) INFER_CASE(8, 64) INFER_CASE(1, 128) INFER_CASE(2, 128) INFER_CASE(4, 128) INFER_CASE(7, 128)
  INFER_CASE(8, 128)
#undef INFER_CASE
  return nullptr;
}
#endif

// Whether the int8 cache takes q8i_task (tests turn it off to check the general loops on this host).
inline std::atomic<bool>& q8_fixed_on() {
  static std::atomic<bool> on{true};
  return on;
}

// The part of a row's context a query sees: from its window's first position `start` (0: the whole
// context) to the end. Tasks walk whole blocks, so they start at start's block and give the `skip` tokens
// before start in that block probability 0; blocks before it are never read (a sliding-window sequence
// has given them back).
struct Visible {
  int64_t first_block, len, skip;  // len: tokens from first_block's first one to the end of the context
};
inline Visible visible(int64_t context_len, int64_t start, int64_t block_size) {
  const int64_t first_block = start / block_size;
  return {first_block, context_len - first_block * block_size, start - first_block * block_size};
}

// decode_kernel on an int8 cache (rows of head_dim values and a bfloat16 scale); q and out are T.
template <typename T>
void decode_kernel_q8(const T* q, const int8_t* k_cache, const int8_t* v_cache, const int64_t* block_tables,
                      const int64_t* context_lens, const int64_t* starts, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, float softcap) {
  const int64_t group = num_heads / num_kv_heads;
  const Q8Layout layout(num_kv_heads, block_size, head_dim);
  const int64_t token_stride = layout.row, head_stride = layout.head, block_stride = layout.block;
#if defined(__AVX512F__) || defined(__AVX2__)
  const Q8Task fixed = q8_fixed_on() ? pick_q8_task(group, head_dim) : nullptr;
#endif
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads;
      const Visible vis = visible(context_lens[s], starts ? starts[s] : 0, block_size);
      const int64_t len = vis.len, skip = vis.skip;
      const int64_t* table = block_tables + s * max_blocks + vis.first_block;
      for (int64_t g = 0; g < group; ++g)
        load_row(q + (s * num_heads + kvh * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
      for (int64_t g = 0; g < group; ++g) hadamard_head_(qf.data() + g * head_dim, head_dim);  // as the keys are
      const float turned_scale = scale / static_cast<float>(hadamard_block(head_dim));
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] *= turned_scale;
      scores.assign(group * len, 0.f);
#if defined(__AVX512F__) || defined(__AVX2__)
      if (fixed != nullptr) {
        fixed(qf.data(), k_cache, v_cache, table, len, skip, block_size, block_stride, token_stride, kvh * head_stride,
              scores.data(), acc.data(), softcap);
      } else
#endif
      {
        const auto token_row = [&](const int8_t* cache, int64_t t) {
          return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * head_stride;
        };
        for (int64_t t = 0; t < len; ++t) {
          const int8_t* k = token_row(k_cache, t);
          const float ks = q8_scale(k, head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
            scores[g * len + t] = dot * ks;
          }
        }
        cap_scores(scores.data(), group * len, softcap);
        for (int64_t g = 0; g < group; ++g) {
          softmax_row(scores.data() + g * len + skip, len - skip);
          std::fill_n(scores.data() + g * len, skip, 0.f);
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t t = 0; t < len; ++t) {
          const int8_t* v = token_row(v_cache, t);
          const float vs = q8_scale(v, head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * len + t] * vs;
            float* ag = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * static_cast<float>(v[d]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out + (s * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// One task's output rows (its G query heads, head_dim each) from its spans' parts (bf16_task's sums, tops and
// totals, `part` floats apart): the sums over spans weighted by exp(top - the largest top), over the totals
// weighted alike. Each top is overwritten by its weight (the parts are the call's scratch: no allocation here).
template <typename T>
void merge_spans(float* parts, int64_t spans, int64_t part, int64_t group, int64_t head_dim, T* out) {
  for (int64_t g = 0; g < group; ++g) {
    const int64_t top = group * head_dim + g, total = top + group;
    float most = -std::numeric_limits<float>::infinity(), denominator = 0.f;
    for (int64_t i = 0; i < spans; ++i) most = std::max(most, parts[i * part + top]);
    for (int64_t i = 0; i < spans; ++i) {
      float& weight = parts[i * part + top];
      weight = std::exp(weight - most);
      denominator += weight * parts[i * part + total];
    }
    const float inv = 1.f / denominator;
    for (int64_t d = 0; d < head_dim; ++d) {
      float sum = 0.f;
      for (int64_t i = 0; i < spans; ++i) sum += parts[i * part + top] * parts[i * part + g * head_dim + d];
      out[g * head_dim + d] = static_cast<T>(sum * inv);
    }
  }
}

// A decode call's (sequence, KV head) tasks on a bfloat16 cache, each cut into spans of kSpanTokens tokens taken
// by the threads as work items, then merged (merge_spans). A batch-1 step of a model with 3 KV heads on 2 threads
// ran one whole task a thread, one thread two and the other one: at 1,500 tokens of context the step took 1.07x
// as long (Zen 5). A task's spans follow from its own context length alone, so a sequence gets the same bits
// alone and in any batch.
constexpr int64_t kSpanTokens = 128;  // whole 16-token groups (bf16_task's scoring)

template <typename T>
void decode_bf16(Bf16Task task_fn, const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                 const int64_t* context_lens, const int64_t* starts, T* out, int64_t num_seqs, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                 float softcap) {
  const int64_t group = num_heads / num_kv_heads, tasks = num_seqs * num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim, block_stride = block_size * token_stride;
  const int64_t part = group * (head_dim + 2);  // a span's sums, then its tops, then its totals
  std::vector<int64_t> first(tasks + 1, 0);     // each task's first work item
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t s = task / num_kv_heads;
    const int64_t len = visible(context_lens[s], starts ? starts[s] : 0, block_size).len;
    first[task + 1] = first[task] + std::max<int64_t>(1, (len + kSpanTokens - 1) / kSpanTokens);
  }
  const int64_t items = first[tasks];
  std::vector<float> parts(items * part);
  const auto* k = reinterpret_cast<const uint16_t*>(k_cache);
  const auto* v = reinterpret_cast<const uint16_t*>(v_cache);
  const auto rows_of = [&](int64_t task) {  // the task's first query head's output row
    return out + (task / num_kv_heads * num_heads + task % num_kv_heads * group) * head_dim;
  };
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    int64_t task = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t item = begin; item < end; ++item) {
      while (first[task + 1] <= item) ++task;
      const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads, spans = first[task + 1] - first[task];
      const Visible vis = visible(context_lens[s], starts ? starts[s] : 0, block_size);
      const int64_t t0 = (item - first[task]) * kSpanTokens, t1 = std::min(vis.len, t0 + kSpanTokens);
      float* p = parts.data() + item * part;
      const uint16_t* qrows[8];
      for (int64_t g = 0; g < group; ++g)
        qrows[g] = reinterpret_cast<const uint16_t*>(q + (s * num_heads + kvh * group + g) * head_dim);
      scores.resize(group * (t1 - t0));
      task_fn(qrows, k, v, block_tables + s * max_blocks + vis.first_block, t0, t1, vis.skip, block_size, block_stride,
              token_stride, kvh * head_dim, scale, scores.data(), p, p + group * head_dim,
              p + group * head_dim + group, softcap);
      if (spans == 1) merge_spans(p, 1, part, group, head_dim, rows_of(task));
    }
  });
  if (items == tasks) return;  // every task one span, merged in place
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      if (first[task + 1] - first[task] > 1)
        merge_spans(parts.data() + first[task] * part, first[task + 1] - first[task], part, group, head_dim,
                    rows_of(task));
  });
}
#endif

template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, const int64_t* starts, T* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                   float scale, float softcap, bool bf16_dots = true) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;    // between tokens of a block
  const int64_t block_stride = block_size * token_stride;  // between blocks
#if defined(__AVX512F__) || defined(__AVX2__)
  const FixedTask fixed = pick_fixed_task<T>(group, head_dim);
#endif
#if defined(__AVX512BF16__)
  if (const Bf16Task bf16 = std::is_same_v<T, at::BFloat16> && bf16_dots ? pick_bf16_task(group, head_dim) : nullptr) {
    decode_bf16(bf16, q, k_cache, v_cache, block_tables, context_lens, starts, out, num_seqs, num_heads, num_kv_heads,
                head_dim, block_size, max_blocks, scale, softcap);
    return;
  }
#endif
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), row(head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kvh = task % num_kv_heads;
      const Visible vis = visible(context_lens[s], starts ? starts[s] : 0, block_size);
      const int64_t len = vis.len, skip = vis.skip;
      const int64_t* table = block_tables + s * max_blocks + vis.first_block;
      const auto token_row = [&](const T* cache, int64_t t) {  // token t's row for this KV head
        return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kvh * head_dim;
      };
      const auto write_out = [&] {  // the float accumulators of this task's query heads, as T
        for (int64_t g = 0; g < group; ++g) {
          T* o = out + (s * num_heads + kvh * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(acc[g * head_dim + d]);
        }
      };
      for (int64_t g = 0; g < group; ++g)
        load_row(q + (s * num_heads + kvh * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
      scores.assign(group * len, 0.f);
#if defined(__AVX512F__) || defined(__AVX2__)
      if (fixed != nullptr) {
        for (int64_t i = 0; i < group * head_dim; ++i) qf[i] *= scale;
        fixed(qf.data(), k_cache, v_cache, table, len, skip, block_size, block_stride, token_stride, kvh * head_dim,
              scores.data(), acc.data(), softcap);
        write_out();
        continue;
      }
#endif
#if defined(__AVX512F__)
      if (head_dim % 16 == 0) {
        for (int64_t t = 0; t < len; ++t) {
          const T* k = token_row(k_cache, t);
          score_row(qf.data(), k, scores.data() + t, group, head_dim, len);
        }
        for (int64_t i = 0; i < group * len; ++i) scores[i] *= scale;
      } else
#endif
      for (int64_t t = 0; t < len; ++t) {
        const T* k = token_row(k_cache, t);
        load_row(k, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
          scores[g * len + t] = dot * scale;
        }
      }
      cap_scores(scores.data(), group * len, softcap);
      for (int64_t g = 0; g < group; ++g) {
#if defined(__AVX512F__)
        softmax_inplace(scores.data() + g * len + skip, len - skip);
#else
        softmax_row(scores.data() + g * len + skip, len - skip);
#endif
        std::fill_n(scores.data() + g * len, skip, 0.f);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(__AVX512F__)
      if (head_dim % 16 == 0) {
        for (int64_t t = 0; t < len; ++t) {
          const T* v = token_row(v_cache, t);
          accumulate_row(scores.data() + t, len, v, acc.data(), group, head_dim);
        }
      } else
#endif
      for (int64_t t = 0; t < len; ++t) {
        const T* v = token_row(v_cache, t);
        load_row(v, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
      }
      write_out();
    }
  });
}

}  // namespace

// Every decode sequence's context length, window start (or none) and used block ids, checked against its table
// and the cache before anything is read: kernels/csrc/step_layers.cpp checks a step's tables once with this, for
// every layer.
inline void check_decode_tables(const int64_t* lens, const int64_t* tables, const int64_t* starts, int64_t num_seqs,
                                int64_t max_blocks, int64_t block_size, int64_t num_blocks) {
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] > 0 && lens[s] <= max_blocks * block_size, "paged_decode_attention: context length ",
                lens[s], " of sequence ", s, " is outside 1..", max_blocks * block_size,
                " (its block table's ", max_blocks, " blocks of ", block_size, " tokens)");
    const int64_t first = starts ? starts[s] : 0;
    TORCH_CHECK(first >= 0 && first < lens[s], "paged_decode_attention: start ", first, " of sequence ", s,
                " is outside 0..", lens[s] - 1, " (its context length less one)");
    const int64_t* table = tables + s * max_blocks;
    for (int64_t b = first / block_size, used = (lens[s] + block_size - 1) / block_size; b < used; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "paged_decode_attention: block id ", table[b],
                  " at block_tables[", s, "][", b, "] is outside the cache's ", num_blocks, " blocks");
  }
}

// q: [seqs, heads, head_dim]; k_cache, v_cache: [blocks, block_size, kv_heads, head_dim] of q's dtype, or
// int8 [blocks, kv_heads, block_size, head_dim + 2] (values and a bfloat16 scale a row, head-major);
// block_tables: [seqs, max_blocks] int64; context_lens: [seqs] int64; starts: none, or [seqs] int64, the
// first position each query sees (a sliding window's: position - window + 1, at least 0). Returns [seqs,
// heads, head_dim]. Every index is checked before any is used (the kernel reads the cache through them): a
// context length in 1 .. max_blocks * block_size, a start in 0 .. length - 1, and each block id it reaches
// in 0 .. blocks - 1. Entries of a table before its start's block or past its context are never read and
// may hold anything. softcap > 0: each scaled score becomes tanh(score / softcap) * softcap before the
// softmax (Gemma 2's attention logit soft-capping); 0: none. bf16_dots: a bfloat16 cache's scores on vdpbf16ps
// where the build has AVX-512 BF16 (bf16_task); false: its rows widened to float32 and FMAs (the float path),
// which the tune stage may choose per batch (faster by a layer on an AMX Xeon, slower on AMD's Zen 4/5).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     c10::optional<torch::Tensor> starts_opt, double softcap = 0.0,
                                     bool bf16_dots = true) {
  for (const auto& t : {q, k_cache, v_cache, block_tables, context_lens})
    TORCH_CHECK(t.device().is_cpu(), "paged_decode_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q must be [seqs, heads, d] and the caches [blocks, block_size, kv_heads, d] "
              "of one shape; got q ", q.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((q8 || q.scalar_type() == k_cache.scalar_type()) && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: the caches must share a dtype, q's or int8 (a quantized cache); got q ",
              q.scalar_type(), ", k_cache ", k_cache.scalar_type(), ", v_cache ", v_cache.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(q8 ? 2 : 1),
                num_kv_heads = k_cache.size(q8 ? 1 : 2);
  TORCH_CHECK(num_kv_heads > 0 && block_size > 0 && head_dim > 0 && num_heads % num_kv_heads == 0 &&
                  k_cache.size(3) == head_dim + (q8 ? 2 : 0),
              "paged_decode_attention: head layout mismatch (an int8 cache is [blocks, kv_heads, block_size, "
              "head_dim + 2]: rows of values, then a bfloat16 scale); got q ", q.sizes(), " and caches ",
              k_cache.sizes());
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs && context_lens.dim() == 1 &&
                  context_lens.size(0) == num_seqs,
              "paged_decode_attention: block_tables must be [seqs, max_blocks] and context_lens [seqs] for ",
              num_seqs, " sequences; got ", block_tables.sizes(), " and ", context_lens.sizes());
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  torch::Tensor starts_t;
  const int64_t* starts = nullptr;
  if (starts_opt.has_value()) {
    starts_t = starts_opt->contiguous();
    TORCH_CHECK(starts_t.device().is_cpu() && starts_t.scalar_type() == at::kLong && starts_t.dim() == 1 &&
                    starts_t.size(0) == num_seqs,
                "paged_decode_attention: starts must be [seqs] int64 on the CPU for ", num_seqs, " sequences; got ",
                starts_t.sizes(), " ", starts_t.scalar_type());
    starts = starts_t.data_ptr<int64_t>();
  }
  check_decode_tables(lens, tables, starts, num_seqs, max_blocks, block_size, num_blocks);
  TORCH_CHECK(softcap >= 0.0, "paged_decode_attention: softcap must be 0 (none) or positive; got ", softcap);
  auto out = torch::empty_like(q);
  const auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    if (q8) {
      decode_kernel_q8<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                                 block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), starts,
                                 out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                 max_blocks, static_cast<float>(scale), static_cast<float>(softcap));
      return;
    }
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), starts,
                            out.data_ptr<scalar_t>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                            max_blocks, static_cast<float>(scale), static_cast<float>(softcap), bf16_dots);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: float32, bfloat16 or float16 only");
  }
  return out;
}

// Every slot a step writes, checked against the cache's capacity (blocks x block_size) before anything is written:
// store_kv_ and kernels/csrc/step_layers.cpp's decode steps.
inline void check_slots(const int64_t* slot, int64_t n, int64_t capacity) {
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "store_kv_: slot ", slot[t], " outside the cache of ", capacity);
}

// A cache of the model's dtype: row t of k and of v (`bytes` each, rows `k_stride` / `v_stride` bytes apart) copied
// into slot[t] of k_cache and v_cache.
inline void store_rows(char* k_cache, char* v_cache, const int64_t* slot, int64_t n, const char* k, int64_t k_stride,
                       const char* v, int64_t v_stride, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(k_cache + slot[t] * bytes, k + t * k_stride, bytes);
    std::memcpy(v_cache + slot[t] * bytes, v + t * v_stride, bytes);
  }
}

// Writes a step's new keys and values into their cache slots, both in one call: k, v [T, kv_heads,
// head_dim] with rows that may be strided (slices of the fused qkv projection are); slots [T] int64,
// each block * block_size + offset. Two index_copy_ calls otherwise, twice the dispatch per layer.
// An int8 cache ([blocks, kv_heads, block_size, head_dim + 2]) gets each (token, KV head) row quantized as it
// is written.
void store_kv_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  for (const auto& t : {k_cache, v_cache, slots, k, v}) TORCH_CHECK(t.device().is_cpu(), "store_kv_: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv_: caches must be contiguous [blocks, block_size, kv_heads, d] (int8: [blocks, kv_heads, "
              "block_size, d + 2]) of one shape and dtype");
  const bool q8 = k_cache.scalar_type() == at::kChar;
  const int64_t block_size = k_cache.size(q8 ? 2 : 1), kv_heads = k_cache.size(q8 ? 1 : 2);
  const int64_t head_dim = k_cache.size(3) - (q8 ? 2 : 0);
  const int64_t row = kv_heads * k_cache.size(3), capacity = k_cache.size(0) * block_size;
  for (const auto& t : {k, v}) {
    TORCH_CHECK(t.dim() == 3 && t.size(1) == kv_heads && t.size(2) == head_dim && t.stride(2) == 1 &&
                    t.stride(1) == t.size(2) && (q8 || t.scalar_type() == k_cache.scalar_type()) &&
                    t.scalar_type() == k.scalar_type() && t.size(0) == slots.numel(),
                "store_kv_: k and v must be [T, kv_heads, head_dim] of the cache's dtype (a float dtype for an int8 "
                "cache, whose rows are head_dim + 2), one row per slot; got k ", k.sizes(), " ", k.scalar_type(),
                ", cache ", k_cache.sizes(), " ", k_cache.scalar_type());
  }
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.dim() == 1,
              "store_kv_: slots must be a contiguous [T] int64 tensor");
  const int64_t* slot = slots.data_ptr<int64_t>();
  check_slots(slot, slots.numel(), capacity);
  if (q8) {
    const auto run = [&](auto tag) {
      using scalar_t = decltype(tag);
      int8_t* kc = k_cache.data_ptr<int8_t>();
      int8_t* vc = v_cache.data_ptr<int8_t>();
      const scalar_t* ks = k.data_ptr<scalar_t>();
      const scalar_t* vs = v.data_ptr<scalar_t>();
      std::vector<float> turned(head_dim);
      const Q8Layout layout(kv_heads, block_size, head_dim);
      for (int64_t t = 0; t < slots.numel(); ++t)
        for (int64_t h = 0; h < kv_heads; ++h) {
          // block slot / block_size, head h, token slot % block_size
          const int64_t at = (slot[t] / block_size) * layout.block + h * layout.head + (slot[t] % block_size) * layout.row;
          load_row(ks + t * k.stride(0) + h * head_dim, turned.data(), head_dim);
          hadamard_head_(turned.data(), head_dim);  // keys turned (above hadamard_block)
          q8_store_row(turned.data(), kc + at, head_dim);
          q8_store_row(vs + t * v.stride(0) + h * head_dim, vc + at, head_dim);
        }
    };
    switch (k.scalar_type()) {
      case at::kFloat: run(float{}); break;
      case at::kBFloat16: run(at::BFloat16{}); break;
      case at::kHalf: run(at::Half{}); break;
      default: TORCH_CHECK(false, "store_kv_: k and v float32, bfloat16 or float16 for an int8 cache");
    }
    return;
  }
  const int64_t bytes = row * k_cache.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  store_rows(kc, vc, slot, slots.numel(), ks, k.stride(0) * k.element_size(), vs, v.stride(0) * v.element_size(), bytes);
}

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernels alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL, as torch's own ops run: the server's event loop goes on while a layer attends
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("starts") = py::none(), py::arg("softcap") = 0.0, py::arg("bf16_dots") = true,
        py::call_guard<py::gil_scoped_release>());
  m.def("store_kv_", &store_kv_, "write new keys and values into their paged cache slots (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_bf16_dots", [] {
#if defined(__AVX512BF16__)
    return true;
#else
    return false;  // built without AVX-512 BF16: the float path is the only one
#endif
  }, "whether a bfloat16 cache's scores can run on vdpbf16ps in this build (paged_decode_attention's bf16_dots)");
  m.def("use_q8_fixed_path", [](bool on) { q8_fixed_on() = on; },
        "whether an int8 cache takes the register-resident task for its shape (tests: false checks the general loops)");
}
#endif
