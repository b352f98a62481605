// The small elementwise steps of a decoder layer, fused, on the CPU: RMSNorm with the residual add
// folded in, the rotary embedding applied in place to q and k, and the MLP's silu(gate) * up.
//
// Unfused, each is five to ten torch ops per layer, each a pass over memory plus dispatch
// overhead; for a short prompt chunk or a decode batch that overhead rivals the matmuls. Every
// step rounds to the storage dtype exactly where the unfused torch ops (and transformers) round:
// the rotary and the residual add are bit-identical to them, the norm differs only in the order
// its float32 sum of squares adds up, and SiLU's exp is a polynomial good to about 2e-7 relative
// (torch's is a different one), so a bfloat16 result can differ in its last bit, rarely. Built without -ffast-math and with -ffp-contract=off for
// that reason (kernels/layer_ops.py).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "float_storage.h"
#include "simd_math.h"

#include <cmath>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using infer::from_float;
using infer::to_float;

// What a float32 value becomes after a torch op writes it in dtype T.
template <typename T>
inline float round_to(float f) { return to_float(from_float<T>(f)); }

// Rows per task: small inputs (a decode step) stay on one thread.
inline int64_t grain(int64_t row_len) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_len, 1)); }

// out = weight * (x / rms(x)), the normalised value rounded to T before the scale, as in
// transformers' LlamaRMSNorm. When `residual` is given, x + residual is first written to
// residual and normalised instead (the pre-norm block's residual stream).
template <typename T>
void rms_norm_rows(const T* x, int64_t x_stride, T* residual, const T* weight, T* out, int64_t rows, int64_t h,
                   float eps) {
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> v(h);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      if (residual != nullptr) {
        T* __restrict rr = residual + r * h;
        float* __restrict vv = v.data();
        for (int64_t i = 0; i < h; ++i) vv[i] = round_to<T>(to_float(xr[i]) + to_float(rr[i]));
        for (int64_t i = 0; i < h; ++i) rr[i] = from_float<T>(vv[i]);
      } else {
        for (int64_t i = 0; i < h; ++i) v[i] = to_float(xr[i]);
      }
      float lanes[16] = {0.f};
      int64_t i = 0;
      for (; i + 16 <= h; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += v[i + l] * v[i + l];
      float ss = 0.f;
      for (; i < h; ++i) ss += v[i] * v[i];
      for (int l = 0; l < 16; ++l) ss += lanes[l];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
      T* o = out + r * h;
      for (int64_t j = 0; j < h; ++j) o[j] = from_float<T>(to_float(weight[j]) * round_to<T>(v[j] * inv));
    }
  });
}

// SiLU on float32 values: g / (1 + exp(-g)).
inline float silu(float g) { return g / (1.f + std::exp(-g)); }

#if defined(__AVX512F__)
// The same for 16 lanes; exp(-g) overflowing to infinity makes it -0, as it should.
inline __m512 silu16(__m512 g) {
  const __m512 e = infer::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}

// 16 values of T <-> float32 lanes; to T rounds to nearest even, as from_float does.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) { infer::store_bf16(p, v); }
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// v rounded to T and back, as a torch op writing T and the next reading it would do.
inline __m512 round16(__m512 v, float) { return v; }
inline __m512 round16(__m512 v, at::BFloat16) {
  return _mm512_castsi512_ps(_mm512_and_si512(infer::bf16_round_bits(v), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m512 round16(__m512 v, at::Half) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(__AVX2__) && defined(__FMA__)
// The avx2 class's SiLU on 8 lanes (its scalar std::exp loop took 9x the AVX-512 path's time: 0.94 ms a layer for a
// 256-token prompt, 9 us a decode step's layer). exp8 stops at e^88: past the float32 range exp(-g) overflows and
// SiLU is g / inf = -0, as with exp16, torch and the scalar path.
inline __m256 silu8(__m256 g) {
  const __m256 neg = _mm256_sub_ps(_mm256_setzero_ps(), g);
  const __m256 q = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), infer::exp8(neg)));
  const __m256 overflow = _mm256_cmp_ps(neg, _mm256_set1_ps(88.72283935f), _CMP_GT_OQ);
  return _mm256_blendv_ps(q, _mm256_mul_ps(g, _mm256_setzero_ps()), overflow);
}

// 8 values of T <-> float32 lanes; to T rounds to nearest even, as from_float does.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(at::BFloat16* p, __m256 v) { infer::store_bf16(p, v); }
inline void store8(at::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
// v rounded to T and back, as a torch op writing T and the next reading it would do.
inline __m256 round8(__m256 v, float) { return v; }
inline __m256 round8(__m256 v, at::BFloat16) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return _mm256_castsi256_ps(_mm256_and_si256(infer::bf16_round_bits(v), high));
}
inline __m256 round8(__m256 v, at::Half) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// Rotates the first `heads` heads of each row in place: x*cos + rotate_half(x)*sin, with cos and
// sin (float32 tables indexed by position) rounded to T first and each product rounded, as
// transformers' apply_rotary_pos_emb computes it in T.
template <typename T>
void rotary_rows(T* x, int64_t row_stride, const int64_t* positions, const float* cos, const float* sin,
                 int64_t rows, int64_t heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  at::parallel_for(0, rows, grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + positions[r] * head_dim;
      const float* s = sin + positions[r] * head_dim;
      int64_t vec = 0;  // pairs done 16 at a time
#if defined(__AVX512F__)
      // 16 pairs at once, the same products and roundings (a decode row's 12 heads took ~5 us a layer scalar); the
      // position's rounded cos and sin loaded once for all the row's heads (loaded once a head, a 256-token prompt's
      // 256 x 12 heads took 44 us against 35, Xeon amx class, interleaved)
      for (; vec + 16 <= half; vec += 16) {
        const __m512 c1 = round16(load16(c + vec), T{}), s1 = round16(load16(s + vec), T{});
        const __m512 c2 = round16(load16(c + vec + half), T{}), s2 = round16(load16(s + vec + half), T{});
        for (int64_t hd = 0; hd < heads; ++hd) {
          T* xh = x + r * row_stride + hd * head_dim + vec;
          const __m512 x1 = load16(xh), x2 = load16(xh + half);
          const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
          const __m512 a = _mm512_add_ps(round16(_mm512_mul_ps(x1, c1), T{}), round16(_mm512_mul_ps(neg_x2, s1), T{}));
          const __m512 b = _mm512_add_ps(round16(_mm512_mul_ps(x2, c2), T{}), round16(_mm512_mul_ps(x1, s2), T{}));
          store16(xh, a);
          store16(xh + half, b);
        }
      }
#endif
      for (int64_t hd = 0; hd < heads; ++hd) {
        T* xh = x + r * row_stride + hd * head_dim;
        for (int64_t i = vec; i < half; ++i) {
          const float x1 = to_float(xh[i]), x2 = to_float(xh[i + half]);
          const float a = round_to<T>(x1 * round_to<T>(c[i])) + round_to<T>(-x2 * round_to<T>(s[i]));
          const float b = round_to<T>(x2 * round_to<T>(c[i + half])) + round_to<T>(x1 * round_to<T>(s[i + half]));
          xh[i] = from_float<T>(a);
          xh[i + half] = from_float<T>(b);
        }
      }
    }
  });
}

// out[r] = silu(gate) * up for rows [gate | up] of x, SiLU rounded to T before the product, as
// torch's F.silu(gate) * up rounds.
template <typename T>
void silu_mul_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, grain(2 * inter), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + inter;
      T* o = out + r * inter;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= inter; i += 16)
        store16(o + i, _mm512_mul_ps(round16(silu16(load16(gate + i)), T{}), load16(up + i)));
#elif defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= inter; i += 8) store8(o + i, _mm256_mul_ps(round8(silu8(load8(gate + i)), T{}), load8(up + i)));
#endif
      for (; i < inter; ++i) o[i] = from_float<T>(round_to<T>(silu(to_float(gate[i]))) * to_float(up[i]));
    }
  });
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    case at::kHalf: f(at::Half{}); break;
    default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only");
  }
}

void check_rows(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": expects a [rows, features] tensor with contiguous rows");
}

}  // namespace

// RMSNorm of the rows of x ([T, H], rows may be strided). Returns a new [T, H] tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [H] tensor of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), x.stride(0), nullptr, weight.data_ptr<T>(), out.data_ptr<T>(), x.size(0),
                     x.size(1), static_cast<float>(eps));
  });
  return out;
}

// residual += x; x = RMSNorm(residual). Both [T, H] contiguous, updated in place.
void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() && x.dim() == 2,
              "add_rms_norm_: x and residual must be contiguous [T, H] tensors of one shape");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm_: x, residual and weight must share a dtype; weight is [H]");
  dispatch(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), x.size(1), residual.data_ptr<T>(), weight.data_ptr<T>(), x.data_ptr<T>(),
                     x.size(0), x.size(1), static_cast<float>(eps));
  });
}

// Rotary embedding in place on the first `heads` heads of each row of x ([T, >= heads * head_dim],
// rows may be strided, e.g. the q and k part of a fused qkv projection). cos, sin: float32
// [positions, head_dim]; positions: int64 [T].
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t heads,
             int64_t head_dim) {
  check_rows(x, "rotary_");
  TORCH_CHECK(x.size(1) >= heads * head_dim && head_dim % 2 == 0, "rotary_: rows shorter than heads * head_dim");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == x.size(0),
              "rotary_: positions must be a contiguous int64 [T] tensor");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
              "rotary_: cos and sin must be contiguous float32 [positions, head_dim] tables");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "rotary_: position ", pos[r], " outside the table of ",
                cos.size(0));
  dispatch(x.scalar_type(), "rotary_", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(x.data_ptr<T>(), x.stride(0), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                   sin.data_ptr<float>(), x.size(0), heads, head_dim);
  });
}

// silu(x[:, :I]) * x[:, I:] for x [T, 2I] (rows may be strided): the MLP's activation on the fused
// gate/up projection, one pass instead of split, silu and mul. Returns a new [T, I] tensor.
torch::Tensor silu_mul(torch::Tensor x) {
  check_rows(x, "silu_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_mul: expects [T, 2 * intermediate] (gate then up)");
  const int64_t inter = x.size(1) / 2;
  auto out = torch::empty({x.size(0), inter}, x.options());
  dispatch(x.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), x.size(0), inter);
  });
  return out;
}

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernels alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("silu_mul", &silu_mul, "silu(gate) * up over the fused gate/up rows (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = RMSNorm(residual), in place (CPU)");
  m.def("rotary_", &rotary_, "rotary embedding in place on the leading heads of each row (CPU)");
}
#endif
