// Vectorised float32 math shared by the CPU kernels.
//
// No multiply here is left for the compiler to fuse with an add: step_layers.cpp includes this header where
// contraction is off (for its layer ops) and the attention modules where it is on, so a fusable pair would
// round differently in the one-call step than in the Python layer loop (a bfloat16 probability now and then
// one step apart: tests/test_fused_step.py compares the two bit for bit). Each multiply-add is an explicit
// FMA or an explicit barrier between the two, the same instructions in every build.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace infer {

// exp16's polynomial on 8 lanes (AVX2 has no scalef: 2^n goes into the exponent bits).
__attribute__((always_inline)) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  __asm__("" : "+x"(t));  // t rounded, never fused into f's subtraction (see the top of the file)
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  // n in [-126, 128): 2^n as float bits; p in [0.7, 1.42], so p * 2^n stays finite up to e^88
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lanes 0 .. n - 1 set (all bits), the others clear: n <= 0 none, n >= 8 all.
__attribute__((always_inline)) inline __m256i lanes_below(int64_t n) {
  const int live = n <= 0 ? 0 : n >= 8 ? 8 : static_cast<int>(n);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(live), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

__attribute__((always_inline)) inline float reduce_max8(__m256 v) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

__attribute__((always_inline)) inline float reduce_add8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// float32 bits rounded to the nearest even bfloat16, which sits in the high half of each lane (8 lanes).
__attribute__((always_inline)) inline __m256i bf16_round_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

// 8 lanes rounded to the nearest even bfloat16 (as infer::from_float rounds finite values), stored at p
__attribute__((always_inline)) inline void store_bf16(void* p, __m256 v) {
  const __m256i b = _mm256_srli_epi32(bf16_round_bits(v), 16);
  _mm_storeu_si128(static_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// The AVX-512 softmax_row_bf16 below on 8 lanes, for the avx2 class's chunk attention: p[j] = exp(scale * s[j] -
// max) for the first `visible` scores, zero from there to `width`, rounded to bfloat16 (nearest even) and stored
// as float32 (the rounded values, exact: the kernel broadcasts them as they are, widened once here); returns
// 1 / (the sum of the rounded values).
inline float softmax_row_bf16(const float* s, int64_t visible, int64_t width, float scale, float* p) {
  const __m256 vscale = _mm256_set1_ps(scale), none = _mm256_set1_ps(-INFINITY);
  __m256 vmax = none;
  for (int64_t j = 0; j < visible; j += 8) {
    const __m256i lanes = lanes_below(visible - j);
    const __m256 x = _mm256_mul_ps(_mm256_maskload_ps(s + j, lanes), vscale);
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(none, x, _mm256_castsi256_ps(lanes)));
  }
  const __m256 m = _mm256_set1_ps(reduce_max8(vmax));
  const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j < visible; j += 8) {
    const __m256i lanes = lanes_below(visible - j);
    const __m256 e = _mm256_and_ps(exp8(_mm256_fmsub_ps(_mm256_maskload_ps(s + j, lanes), vscale, m)),  // scale s - max
                                   _mm256_castsi256_ps(lanes));
    const __m256 rounded = _mm256_and_ps(_mm256_castsi256_ps(bf16_round_bits(e)), high);
    _mm256_maskstore_ps(p + j, lanes_below(width - j), rounded);
    vsum = _mm256_add_ps(vsum, rounded);  // the sum of what P V multiplies: the rounded values
  }
  for (; j < width; j += 8) _mm256_maskstore_ps(p + j, lanes_below(width - j), _mm256_setzero_ps());  // no exp
  return 1.f / reduce_add8(vsum);
}

}  // namespace infer
#endif

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace infer {

// e^x for 16 lanes: 2^n * 2^f with n = round(x log2 e) and Cephes' exp2f polynomial on f in [-1/2, 1/2]
// (relative error about 2e-7); libm's scalar expf would cost more than the arithmetic around it.
// Inputs below -87 give e^-87; large ones saturate to infinity.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  __asm__("" : "+v"(t));  // t rounded, never fused into f's subtraction (see the top of the file)
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// float32 bits rounded to the nearest even bfloat16, which sits in the high half of each lane.
inline __m512i bf16_round_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

// 16 lanes rounded to the nearest even bfloat16 (as infer::from_float rounds finite values): their 16 bits, or
// stored at p
inline __m256i to_bf16(__m512 v) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16)); }
inline void store_bf16(void* p, __m512 v) { _mm256_storeu_si256(static_cast<__m256i*>(p), to_bf16(v)); }

// One attention row's probabilities, unnormalised: p[j] = exp(scale * s[j] - max) for the first
// `visible` scores, zero from there to `width`, rounded to bfloat16 (nearest even) and stored as its
// bits; returns 1 / (the sum of the rounded values), what P V is divided by at the end.
inline float softmax_row_bf16(const float* s, int64_t visible, int64_t width, float scale, uint16_t* p) {
  const __m512 vscale = _mm512_set1_ps(scale);
  __m512 vmax = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < visible; j += 16) {
    const __mmask16 lanes = visible - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (visible - j)) - 1);
    vmax = _mm512_mask_max_ps(vmax, lanes, vmax, _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s + j), vscale));
  }
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j < visible; j += 16) {
    const int64_t live = visible - j >= 16 ? 16 : visible - j;
    const __mmask16 lanes = live == 16 ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        lanes, exp16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(lanes, s + j), vscale, m)));  // scale s - max
    const __m512i rounded = bf16_round_bits(e);
    const __mmask16 store = width - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - j)) - 1);
    _mm256_mask_storeu_epi16(p + j, store, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    // the sum of what P V multiplies: the rounded values
    vsum = _mm512_add_ps(vsum, _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
  }
  for (; j < width; j += 16) {  // past what the row sees: zeros, no exp (a causal prompt's rows, half their width)
    const __mmask16 store = width - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - j)) - 1);
    _mm256_mask_storeu_epi16(p + j, store, _mm256_setzero_si256());
  }
  return 1.f / _mm512_reduce_add_ps(vsum);
}

}  // namespace infer

#endif
