// Inverse-CDF draws over rows of float32 logits, one uniform number a row, for the sampler's non-greedy rows.
//
// The torch route is softmax (a max pass, an exp pass, a normalising pass), then a cumulative sum into a
// second [B, vocab] array and a search in it: ~13 ms a step for 48 rows of a 49,152-token vocabulary on a
// 2-core Zen 5, 12% of a loaded server's step; with top-p or top-k it sorts every row first (~117 ms for 48
// rows, ~2.4 ms a row at batch 1). Here a row's weights are e = exp(s (x - max)) in (0, 1], s = 1 / temperature:
// - temperature alone: the row is read three times and nothing is written: its max, the sum of its weights,
//   then the weights again block by block until the running sum passes u * sum;
// - top-k, top-p, min-p: each is a threshold on the weights (keep e >= v), found without sorting: top-k's v is
//   the k-th largest weight, top-p's the largest v whose weights >= v hold top_p of the mass top-k kept (the
//   smallest prefix of the sorted row that does, as a sort would cut it), min-p's is min_p itself (the largest
//   weight is 1). A threshold is a radix select on the weights' float bits (positive floats order as their
//   bits): a histogram of the top 12 bits over the row, then of the next 12 and the last 8 over the one bin the
//   count or mass crosses in. Ties at a threshold are all kept (top-k may keep more than k tokens on exact ties,
//   as transformers' top-k does).
// Same distribution as the torch route; the sums round differently, so a seeded request's tokens can differ from
// the torch route's where a draw (or a top-p cut) falls within rounding of a boundary. The GIL is released.
//
// A row with no distribution (a NaN anywhere, no finite logit, a +inf one) draws -1.
//
// The draw of one row, shared by sample_rows.cpp (the sampler's rows) and step_layers.cpp (decode bursts of sampled rows).
#pragma once

#include <immintrin.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd_math.h"

namespace infer::sampling {


// e^d where d = s (x - max) >= -87, else 0: exp16 / exp8 return e^-87 below that, and a masked (-inf) token
// must have no mass at all.
constexpr float kFloor = -87.0f;

#if defined(__AVX512F__)
constexpr int64_t W = 16;
inline __m512 weights(const float* x, __m512 m, __m512 s) {
  const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x), m), s);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(kFloor), _CMP_GE_OQ), infer::exp16(d));
}
inline float row_max(const float* x, int64_t n, int64_t& tail, bool& nan) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 unordered = 0;
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const __m512 v = _mm512_loadu_ps(x + j);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  tail = j;
  nan = unordered != 0;
  return _mm512_reduce_max_ps(m);
}
inline float vsum(__m512 v) { return _mm512_reduce_add_ps(v); }
inline __m512 vzero() { return _mm512_setzero_ps(); }
inline __m512 vset(float f) { return _mm512_set1_ps(f); }
inline __m512 vadd(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// the weights at p that are >= cut, the others 0
inline __m512 kept(const float* p, __m512 cut) {
  const __m512 v = _mm512_loadu_ps(p);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, cut, _CMP_GE_OQ), v);
}
using vec = __m512;
#else  // AVX2 + FMA (the lowest class the kernels build for)
constexpr int64_t W = 8;
inline __m256 weights(const float* x, __m256 m, __m256 s) {
  const __m256 d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x), m), s);
  return _mm256_and_ps(_mm256_cmp_ps(d, _mm256_set1_ps(kFloor), _CMP_GE_OQ), infer::exp8(d));
}
inline float row_max(const float* x, int64_t n, int64_t& tail, bool& nan) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 unordered = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const __m256 v = _mm256_loadu_ps(x + j);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  tail = j;
  nan = _mm256_movemask_ps(unordered) != 0;
  return infer::reduce_max8(m);
}
inline float vsum(__m256 v) { return infer::reduce_add8(v); }
inline __m256 vzero() { return _mm256_setzero_ps(); }
inline __m256 vset(float f) { return _mm256_set1_ps(f); }
inline __m256 vadd(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline __m256 kept(const float* p, __m256 cut) {
  const __m256 v = _mm256_loadu_ps(p);
  return _mm256_and_ps(_mm256_cmp_ps(v, cut, _CMP_GE_OQ), v);
}
using vec = __m256;
#endif

inline float weight(float x, float m, float s) {
  const float d = (x - m) * s;
  return d >= kFloor ? std::exp(d) : 0.0f;
}

// The row's max, or NaN when the row has no distribution (a NaN, no finite logit, a +inf one, a bad scale).
inline float checked_max(const float* x, int64_t n, float s) {
  int64_t tail;
  bool nan;
  float m = row_max(x, n, tail, nan);
  for (int64_t j = tail; j < n; ++j) {
    nan |= std::isnan(x[j]);
    m = std::max(m, x[j]);
  }
  if (nan || !std::isfinite(m) || !(s > 0.0f) || !std::isfinite(s)) return std::numeric_limits<float>::quiet_NaN();
  return m;
}

// The first token whose cumulative weight passes u times the total (searchsorted's right side), -1 when there is
// no weight: `block(j)` gives the W weights from token j (whole vectors), `one(j)` a single one (the tail).
template <typename Block, typename One>
inline int64_t draw(int64_t n, float u, Block block, One one) {
  const int64_t whole = n - n % W;
  vec acc = vzero();
  for (int64_t j = 0; j < whole; j += W) acc = vadd(acc, block(j));
  float total = vsum(acc);
  for (int64_t j = whole; j < n; ++j) total += one(j);
  if (!std::isfinite(total) || !(total > 0.0f)) return -1;
  const float target = u * total;
  float run = 0.0f;
  int64_t last = -1;  // the last token with weight, should rounding leave the target unpassed
  for (int64_t j = 0; j < n; j += W) {
    alignas(64) float e[W];
    const int64_t width = std::min(W, n - j);
    if (width == W) {
      vstore(e, block(j));
    } else {
      for (int64_t k = 0; k < width; ++k) e[k] = one(j + k);
    }
    float sum = 0.0f;
    for (int64_t k = 0; k < width; ++k) sum += e[k];
    if (!(sum > 0.0f)) continue;
    if (run + sum <= target) {  // passes the whole block
      run += sum;
      for (int64_t k = width - 1; k >= 0; --k) {
        if (e[k] > 0.0f) {
          last = j + k;
          break;
        }
      }
      continue;
    }
    for (int64_t k = 0; k < width; ++k) {
      if (e[k] > 0.0f) {
        last = j + k;
        run += e[k];
        if (run > target) return last;
      }
    }
  }
  return last;
}

// Temperature alone: the weights computed twice rather than stored.
inline int64_t draw_plain(const float* x, int64_t n, float m, float s, float u) {
  const vec vm = vset(m), vs = vset(s);
  return draw(n, u, [&](int64_t j) { return weights(x + j, vm, vs); }, [&](int64_t j) { return weight(x[j], m, s); });
}

// The sum of the weights >= cut.
inline float kept_sum(const std::vector<float>& e, float cut) {
  const int64_t n = static_cast<int64_t>(e.size()), whole = n - n % W;
  const vec vcut = vset(cut);
  vec acc = vzero();
  for (int64_t j = 0; j < whole; j += W) acc = vadd(acc, kept(e.data() + j, vcut));
  float total = vsum(acc);
  for (int64_t j = whole; j < n; ++j) total += e[j] >= cut ? e[j] : 0.0f;
  return total;
}

inline uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float float_of(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// The largest weight v (of those >= floor, floor > 0) such that the weights >= v number at least `target`
// (by_mass false) or sum to at least it (by_mass true); floor when all of them together fall short. Radix
// select, most significant bits first: 12 bits, then 12, then 8, each level's histogram over the candidates
// left in the bin the running count or mass crossed in.
inline float threshold(const std::vector<float>& e, float floor, bool by_mass, double target,
                std::vector<uint32_t>& candidates) {
  static constexpr int kShift[3] = {20, 8, 0};
  static constexpr uint32_t kMask[3] = {0xFFF, 0xFFF, 0xFF};
  std::array<double, 4096> hist;
  double above = 0.0;  // count or mass of the weights in bins above the current candidates
  uint32_t prefix = 0;  // the bits chosen so far
  for (int level = 0; level < 3; ++level) {
    hist.fill(0.0);
    if (level == 0) {  // the whole row: its weights >= floor (no copy of them)
      for (const float w : e) {
        if (w >= floor) hist[bits_of(w) >> kShift[0]] += by_mass ? w : 1.0;
      }
    } else {
      for (const uint32_t b : candidates) hist[(b >> kShift[level]) & kMask[level]] += by_mass ? float_of(b) : 1.0;
    }
    int64_t bin = -1;
    for (int64_t k = kMask[level]; k >= 0; --k) {
      if (above + hist[k] >= target) {
        bin = k;
        break;
      }
      above += hist[k];
    }
    if (bin < 0) return floor;  // all of them fall short: keep every one
    prefix |= static_cast<uint32_t>(bin) << kShift[level];
    if (level == 0) {  // the weights in that bin go on to the next level
      candidates.clear();
      for (const float w : e) {
        if (w >= floor && bits_of(w) >> kShift[0] == static_cast<uint32_t>(bin)) candidates.push_back(bits_of(w));
      }
    } else {
      size_t kept = 0;
      for (const uint32_t b : candidates) {
        if (((b >> kShift[level]) & kMask[level]) == static_cast<uint32_t>(bin)) candidates[kept++] = b;
      }
      candidates.resize(kept);
    }
  }
  return float_of(prefix);
}

// The row's weights cut by top-k, top-p and min-p, then drawn: -1 when the row has no distribution.
inline int64_t draw_cut(const float* x, int64_t n, float m, float s, float u, int64_t top_k, float top_p, float min_p,
                 std::vector<float>& e, std::vector<uint32_t>& candidates) {
  e.resize(n);
  const int64_t whole = n - n % W;
  const vec vm = vset(m), vs = vset(s);
  for (int64_t j = 0; j < whole; j += W) vstore(e.data() + j, weights(x + j, vm, vs));
  for (int64_t j = whole; j < n; ++j) e[j] = weight(x[j], m, s);
  float cut = std::numeric_limits<float>::min();  // the smallest normal float: tokens of no weight stay out
  if (top_k > 0 && top_k < n) cut = std::max(cut, threshold(e, cut, false, static_cast<double>(top_k), candidates));
  if (top_p < 1.0f) cut = std::max(cut, threshold(e, cut, true, top_p * static_cast<double>(kept_sum(e, cut)),
                                                   candidates));
  cut = std::max(cut, min_p);  // the largest weight is exp(0) = 1
  const vec vcut = vset(cut);
  return draw(n, u, [&](int64_t j) { return kept(e.data() + j, vcut); },
              [&](int64_t j) { return e[j] >= cut ? e[j] : 0.0f; });
}

// Row x's draw (n logits) with weights exp(s (x - max)), cut by top_k (< 1 or >= n: off), top_p (1: off) and min_p
// (0: off), and the uniform u in [0, 1): the token, or -1 where the row has no distribution. e and candidates:
// scratch a caller keeps across rows.
inline int64_t draw_row(const float* x, int64_t n, float s, float u, int64_t top_k, float top_p, float min_p,
                        std::vector<float>& e, std::vector<uint32_t>& candidates) {
  const float m = checked_max(x, n, s);
  if (std::isnan(m)) return -1;
  const bool cut = (top_k > 0 && top_k < n) || top_p < 1.0f || min_p > 0.0f;
  return cut ? draw_cut(x, n, m, s, u, top_k, top_p, min_p, e, candidates) : draw_plain(x, n, m, s, u);
}

}  // namespace infer::sampling
