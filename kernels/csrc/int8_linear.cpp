// int8-weight linears with per-output-channel scales, on every CPU class from AVX2 up (one source, the
// instructions chosen by the build's target flags, kernels/isa.py):
// - W8A16 (`int8_linear`): bfloat16 activations. Each int8 weight is widened to float32 in registers
//   (vpmovsxbd + vcvtdq2ps) and multiplied with FMA against a broadcast x[k]; products of an int8 and a
//   bfloat16 are exact in float32, the sums are float32, and the column's scale and the float32 bias are
//   applied once at the end, y = round_bf16(fma(sum, scale, bias)).
// - W8A8 (`w8a8_linear`): activations quantized per token inside the call exactly as compressed-tensors
//   declares it (scale = absmax / 127.5 in float32, or float32 epsilon for an all-zero row; codes =
//   round-half-even(clamp(x / scale, -128, 127))), int8 x int8 products summed exactly in int32, then
//   y = round_bf16(fma(float(sum), x_scale * w_scale, bias)): the same float32 operations as
//   runtime/model/quant_linear.py's W8A8Linear (torch._int_mm), so without a bias the two agree bit for bit.
//   Without VNNI the int8 pairs are sign-extended to int16 and multiplied with vpmaddwd, which is exact
//   (two products of at most 128 x 128 never leave int32); vpmaddubsw is not used (it saturates at int16).
//   With AVX-512 VNNI, vpdpbusd multiplies unsigned x signed bytes: the activations are offset to
//   u = q + 128 and 128 x sum_k w[k, col], precomputed at pack time, is subtracted from each column's sum.
//   Where the build targets AMX (the `amx` class), prompt chunks run on AMX-INT8 tiles (tdpbusd) over the same
//   packed weights and codes, exact int32 sums again (amx_rows_of_block8).
// - FP8 (`fp8_linear`): fp8 e4m3 weights with per-channel scales and dynamic per-token e4m3 activations
//   (compressed-tensors' FP8_DYNAMIC: scale = absmax / 448 in float32, codes = the float32 x / scale clamped
//   to +-448 and rounded to e4m3, to nearest, ties to even, as torch converts). Each weight byte is decoded in
//   registers (sign-extended, shifted into a float32's exponent and mantissa, times 2^120) and each row's codes
//   are kept as the floats they stand for; a product of two e4m3 values (4 significant bits each) is exact in
//   float32, so the sums are float32 as the declared scheme computes them, then
//   y = round_bf16(fma(sum, x_scale * w_scale, bias)), as W8A8. Same layout and tiles as W8A16, except on
//   AVX-512 BF16 with VBMI, where each byte is looked up as the bfloat16 its value is and multiplied with
//   vdpbf16ps against the codes as bfloat16 (its own pairs layout; see rows_of_block_fp8).
//
// A decode step reads every weight once: an int8 weight is half of a bfloat16 one's bytes. Weights are
// packed once, at load (kernels/int8_linear.py), per block of W = 64 output columns (32 for a weight of at
// most 1024 columns, so a decode step's blocks split evenly over threads, as bf16_linear.cpp does), each
// block one sequential stream:
// - W8A16 and FP8: [N/W][K][W]: row k holds the block's W weights of input k (one cache line at W = 64);
//   FP8 on AVX-512 BF16 with VBMI: [N/W][K/2][W][2], each column's (k, k + 1) bytes side by side.
// - W8A8: [N/W][K/4][W][4]: each 32-bit word holds one column's 4 consecutive k, the operand vpdpbusd
//   takes; without VNNI, (word << 8) >> 8 and word >> 8 in 16-bit halves (arithmetic) give the (k, k+2)
//   and (k+1, k+3) pairs as int16, each multiplied by vpmaddwd against a broadcast pair of x codes.
// Few rows (a decode step) read each block front to back with every sum in registers, lanes = output
// columns, no horizontal reduction; more rows go in tiles that reuse each widened weight vector for
// several rows (a prompt chunk).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "call_buffer.h"
#if defined(__AMX_TILE__)
#include "amx_tiles.h"
#endif
#include "float_storage.h"
#include "prefetch.h"
#include "simd_math.h"
#include "work_split.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

struct Int8Inputs {
  int64_t m, k, blocks, width;
  const float* scale;  // [blocks * width]
  const float* bias;   // [n] or nullptr
};

// dims 3: [blocks, K, W] (W8A16, FP8 decoded to float32); 4: [blocks, K / ks, W, ks], ks k a column's word holds
// (W8A8: 4; FP8 in bfloat16 pairs: 2, K padded to even with zero bytes)
inline Int8Inputs check_int8_inputs(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                                    const torch::Tensor& scales, int64_t n, const c10::optional<torch::Tensor>& bias,
                                    int64_t dims, at::ScalarType codes = at::kChar, int64_t ks = 4) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, name,
              ": x must be a [M, K] bfloat16 tensor with contiguous rows");
  TORCH_CHECK(packed.dim() == dims && packed.scalar_type() == codes && packed.is_contiguous() &&
                  (packed.size(2) == 64 || packed.size(2) == 32) && (dims == 3 || packed.size(3) == ks),
              name, ": the weight must be packed by kernels/int8_linear.py");
  const int64_t m = x.size(0), blocks = packed.size(0), width = packed.size(2);
  const int64_t k = dims == 3 ? packed.size(1) : ks * packed.size(1);
  TORCH_CHECK(x.size(1) == k || (ks == 2 && x.size(1) == k - 1), name, ": x has ", x.size(1),
              " features, the packed weight ", k);
  TORCH_CHECK(n > (blocks - 1) * width && n <= blocks * width, name, ": ", n,
              " output features do not match the packed weight's ", blocks, " blocks");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == blocks * width, name,
              ": scales must be float32 [blocks x width] (kernels/int8_linear.py)");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, name,
                ": bias must be a contiguous float32 [N] tensor");
    b = bias->data_ptr<float>();
  }
  return {m, x.size(1), blocks, width, scales.data_ptr<float>(), b};
}

// A bfloat16's bits as the float32 it is
inline float bf16_value(uint16_t bits) { return infer::to_float(at::BFloat16(bits, at::BFloat16::from_bits())); }

// A float32 rounded to the nearest fp8 e4m3 value (ties to even), |v| <= 448, returned as the float32 it
// stands for. Normal values (|v| >= 2^-6) keep 3 fraction bits: add half a step (less one where the kept
// bits are even) and clear the rest; below 2^-6 e4m3 steps by 2^-9, which (v + c) - c rounds to with
// c = 1.5 x 2^14, whose float32 step is 2^-9. Plain code the compiler vectorizes (no fast-math: it must
// not fold (v + c) - c).
inline float round_e4m3(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  b = (b + 0x7FFFFu + ((b >> 20) & 1u)) & 0xFFF00000u;
  float normal;
  std::memcpy(&normal, &b, 4);
  constexpr float c = 24576.f;  // 1.5 x 2^14
  const float sub = (v + c) - c;
  return std::fabs(v) < 0x1p-6f ? sub : normal;
}

}  // namespace

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

// The vectors of this build: 16 lanes with AVX-512F, 8 with AVX2.
#if defined(__AVX512F__)
using vf = __m512;
using vi = __m512i;
constexpr int kLanes = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vi vizero() { return _mm512_setzero_si512(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline vf vbroadcast_value(float v) { return _mm512_set1_ps(v); }
inline vf vadd_ps(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub_ps(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, rounded once
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
// 16 int8 weights widened to float32 (exact)
inline vf widen_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// 16 fp8 e4m3 weights decoded to float32 (exact): sign-extended, so bits 27-31 of (byte << 20) all hold the
// sign; keeping bit 31 and the 7 exponent and mantissa bits at 20-26 gives the value times 2^-120
inline vf widen_e4m3(const int8_t* p) {
  const __m512i b = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 20);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(static_cast<int32_t>(0x87F00000u)))),
                       _mm512_set1_ps(0x1p120f));
}
inline vi vload_words(const int8_t* p) { return _mm512_loadu_si512(p); }
inline vi vwords(int32_t w) { return _mm512_set1_epi32(w); }
inline vi vadd32(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi vsub32(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi vload_i32(const int32_t* p) { return _mm512_loadu_si512(p); }
inline void vstore_i32(int32_t* p, vi v) { _mm512_storeu_si512(p, v); }
inline vf vcvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline vi madd16(vi a, vi b) { return _mm512_madd_epi16(a, b); }
inline vi even_pairs(vi w) { return _mm512_srai_epi16(_mm512_slli_epi16(w, 8), 8); }  // bytes 0, 2 as int16
inline vi odd_pairs(vi w) { return _mm512_srai_epi16(w, 8); }                        // bytes 1, 3 as int16
#else
using vf = __m256;
using vi = __m256i;
constexpr int kLanes = 8;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vi vizero() { return _mm256_setzero_si256(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline vf vbroadcast_value(float v) { return _mm256_set1_ps(v); }
inline vf vadd_ps(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub_ps(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf widen_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf widen_e4m3(const int8_t* p) {
  const __m256i b = _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 20);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int32_t>(0x87F00000u)))),
                       _mm256_set1_ps(0x1p120f));
}
inline vi vload_words(const int8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vi vwords(int32_t w) { return _mm256_set1_epi32(w); }
inline vi vadd32(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi vsub32(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi vload_i32(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void vstore_i32(int32_t* p, vi v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline vf vcvt(vi v) { return _mm256_cvtepi32_ps(v); }
inline vi madd16(vi a, vi b) { return _mm256_madd_epi16(a, b); }
inline vi even_pairs(vi w) { return _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8); }
inline vi odd_pairs(vi w) { return _mm256_srai_epi16(w, 8); }
#endif

// Row preparation (what the tiles read of x), in vectors: bfloat16 loads, |x|, max, x / scale, clamps, and the
// roundings of quantize_row (to nearest, ties to even), the same float32 operations.
#if defined(__AVX512F__)
inline vf load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vf vabs(vf v) { return _mm512_abs_ps(v); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
// integral floats in [-128, 127] stored as int8
inline void store_i8(int8_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
}
// float32 values that are bfloat16 values (e4m3 codes), as bfloat16 bits
inline void store_bf16_exact(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
// the codes + 128 as unsigned bytes (what vpdpbusd multiplies): vpmovdb keeps the low byte of q + 128, exactly
inline void store_u8_offset(int8_t* p, vf v) {
  const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(u));
}
inline vi vbits(vf v) { return _mm512_castps_si512(v); }
inline vf vfloat(vi v) { return _mm512_castsi512_ps(v); }
inline vi vsrl32(vi v, int n) { return _mm512_srli_epi32(v, n); }
inline vi vsll32(vi v, int n) { return _mm512_slli_epi32(v, n); }
inline vi vmax_u32(vi a, vi b) { return _mm512_max_epu32(a, b); }
inline vi vand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vf vselect_less(vf a, vf b, vf if_less, vf otherwise) {  // a < b ? if_less : otherwise
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), otherwise, if_less);
}
#else
inline vf load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline vf vabs(vf v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline float hmax(vf v) { return infer::reduce_max8(v); }
inline void store_i8(int8_t* p, vf v) {
  const __m256i i = _mm256_cvtps_epi32(v);
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));  // in range: exact
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}
inline void store_u8_offset(int8_t* p, vf v) {  // (as the AVX-512 one; 0 .. 255 packs unsigned exactly)
  const __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(v), _mm256_set1_epi32(128));
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}
inline vi vbits(vf v) { return _mm256_castps_si256(v); }
inline vf vfloat(vi v) { return _mm256_castsi256_ps(v); }
inline vi vsrl32(vi v, int n) { return _mm256_srli_epi32(v, n); }
inline vi vsll32(vi v, int n) { return _mm256_slli_epi32(v, n); }
inline vi vmax_u32(vi a, vi b) { return _mm256_max_epu32(a, b); }
inline vi vand(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vf vselect_less(vf a, vf b, vf if_less, vf otherwise) {
  return _mm256_blendv_ps(otherwise, if_less, _mm256_cmp_ps(a, b, _CMP_LT_OQ));
}
#endif

// |x| max of a bfloat16 row (vectors, then the tail): exact, whatever the order. A 32-bit word holds two bfloat16;
// with both sign bits cleared, word << 16 and word & 0xFFFF0000 are the two |x| as float32 bits, which order as
// unsigned integers as the floats do, so each vector of words takes 4 integer ops for 2 x kLanes values (widening
// each value and a float max chain took 4 cycles a vector, a third of a row's quantization)
inline float row_absmax(const uint16_t* x, int64_t k) {
  vi even = vizero(), odd = vizero();
  const vi no_signs = vwords(0x7FFF7FFF), high = vwords(static_cast<int32_t>(0xFFFF0000u));
  int64_t i = 0;
  for (; i + 2 * kLanes <= k; i += 2 * kLanes) {
    const vi w = vand(vload_words(reinterpret_cast<const int8_t*>(x + i)), no_signs);
    even = vmax_u32(even, vsll32(w, 16));
    odd = vmax_u32(odd, vand(w, high));
  }
  float absmax = hmax(vmax(vfloat(even), vfloat(odd)));
  for (; i < k; ++i) absmax = std::max(absmax, std::fabs(bf16_value(x[i])));
  return absmax;
}

// round_e4m3 on a vector
inline vf vround_e4m3(vf v) {
  const vi b = vbits(v);
  const vi normal = vand(vadd32(vadd32(b, vwords(0x7FFFF)), vand(vsrl32(b, 20), vwords(1))),
                         vwords(static_cast<int32_t>(0xFFF00000u)));
  const vf c = vbroadcast_value(24576.f);
  const vf sub = vsub_ps(vadd_ps(v, c), c);
  return vselect_less(vabs(v), vbroadcast_value(0x1p-6f), sub, vfloat(normal));
}

// One row of x as the W8A16 tiles read it: float32 (exact)
inline void widen_row(const uint16_t* x, int64_t k, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) vstore(out + i, load_bf16(x + i));
  for (; i < k; ++i) out[i] = bf16_value(x[i]);
}

// x / s rounded to nearest in float32, the bits vdivps gives, without its 10-16 cycles a vector (a fifth of a
// 256-row quantization's time): inv = 1 / s rounded (within half an ulp), q = x inv (within 2 ulps), one
// correction by the remainder x - s q (exact under fma) brings q within an ulp, and a second then gives exactly
// x / s rounded (Markstein's theorem, as IA-64's division did; it needs s q and 1 / s free of overflow and
// underflow, which quantize_row's bounds on s give; a quotient so small that it underflows is within 2^-149 of
// its value, far from any code's rounding boundary)
inline vf vquotient(vf x, vf s, vf inv) {
  vf q = vmul(x, inv);
  q = vfma(vfnma(q, s, x), inv, q);
  return vfma(vfnma(q, s, x), inv, q);
}

// compressed-tensors' dynamic per-token quantization of one row, in float32 as torch computes it: scale = absmax /
// 127.5 (int8) or / 448 (e4m3), float32 epsilon for an all-zero row; x / scale clamped to [-128, 127] and rounded
// half to even (int8 codes), or clamped to +-448 and rounded to e4m3 (FP8: the codes' values as float32).
// Returns the row's scale. OFFSET (int8 only): store the codes + 128 as unsigned bytes, VNNI's operand. FP8 codes
// go out as float32 or, for Code uint16_t (AVX-512 builds), as bfloat16 bits (exact), what vdpbf16ps multiplies.
template <bool FP8, typename Code, bool OFFSET = false>
inline float quantize_row(const uint16_t* x, int64_t k, Code* codes) {
  constexpr bool kBits = std::is_same_v<Code, uint16_t>;
  constexpr float range = FP8 ? 448.f : 127.5f, lo = FP8 ? -448.f : -128.f, hi = FP8 ? 448.f : 127.f;
  float scale = row_absmax(x, k) / range;
  if (scale == 0.f) scale = FLT_EPSILON;
  const vf s = vbroadcast_value(scale), vlo = vbroadcast_value(lo), vhi = vbroadcast_value(hi);
  const bool by_inverse = scale >= 0x1p-100f && scale <= 0x1p100f;  // (false for inf or NaN: divided as before)
  const vf inv = vbroadcast_value(1.f / scale);
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    const vf xv = load_bf16(x + i);
    const vf v = vmin(vmax(by_inverse ? vquotient(xv, s, inv) : vdiv(xv, s), vlo), vhi);
    if constexpr (FP8 && kBits) store_bf16_exact(codes + i, vround_e4m3(v));
    else if constexpr (FP8) vstore(codes + i, vround_e4m3(v));
    else if constexpr (OFFSET) store_u8_offset(codes + i, v);  // (the conversion rounds to nearest even, as
    else store_i8(codes + i, v);                                 // nearbyint below: the default rounding mode)
  }
  for (; i < k; ++i) {
    const float v = std::min(std::max(bf16_value(x[i]) / scale, lo), hi);
    if constexpr (FP8 && kBits) {
      const float c = round_e4m3(v);
      uint32_t bits;
      std::memcpy(&bits, &c, 4);
      codes[i] = static_cast<uint16_t>(bits >> 16);
    } else if constexpr (FP8) {
      codes[i] = round_e4m3(v);
    } else {
      const int q = static_cast<int>(std::nearbyint(v));  // the default rounding mode: to nearest, ties to even
      codes[i] = static_cast<int8_t>(static_cast<uint8_t>(OFFSET ? q + 128 : q));
    }
  }
  return scale;
}

// fn(row) for each of m rows: on the calling thread for a decode step's few, over the threads for a prompt chunk
template <typename Fn>
void for_rows(int64_t m, int64_t k, const Fn& fn) {
  if (m * k < (int64_t{1} << 14)) {
    for (int64_t r = 0; r < m; ++r) fn(r);
    return;
  }
  at::parallel_for(0, m, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) fn(r);
  });
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;
// u8 (activation + 128) x s8 (weight), 4 products a lane, summed into int32 exactly (vpdpbusd: no saturation)
inline vi dot4(vi acc, vi xu, vi w) { return _mm512_dpbusd_epi32(acc, xu, w); }
#else
constexpr bool kVnni = false;
#endif

// y[r, col] = fma(sum, scale(r, col), bias[col]) rounded once to bfloat16, for the live columns of one vector.
INFER_INLINE void store_row(vf sum, vf scale, const float* bias, uint16_t* y, int64_t col, int64_t n) {
  if (col + kLanes <= n) {  // a whole vector: rounded to nearest even in registers (finite values), as from_float
    const vf v = vfma(sum, scale, bias != nullptr ? vload(bias + col) : vzero());
    infer::store_bf16(y + col, v);
    return;
  }
  alignas(64) float b[kLanes] = {};
  if (bias != nullptr)
    for (int i = 0; i < kLanes && col + i < n; ++i) b[i] = bias[col + i];
  alignas(64) float out[kLanes];
  vstore(out, vfma(sum, scale, vload(b)));
  for (int i = 0; i < kLanes && col + i < n; ++i) y[col + i] = infer::from_float<at::BFloat16>(out[i]).x;
}

#if defined(__AMX_TILE__)
// An AMX group's outputs: rows x 32 columns from col of y (row 0 at y, ldy apart) from its sums (int32 less 128 x
// colsum, W8A8; or float32), each times x_scale (xscale: the rows', or nullptr) * w_scale (wscale, colsum: from col
// on), plus the bias, rounded once to bfloat16 as store_row does; a row's 32 outputs in one 64-byte store, what
// stays in registers hoisted (written 16 at a time, a 256 x 576 x 3072 W8A8 call's outputs took longer than its
// products)
template <typename Sum>
inline void store_group(const Sum (*sums)[32], int64_t rows, const float* xscale, const float* wscale,
                        const int32_t* colsum, const float* bias, uint16_t* y, int64_t ldy, int64_t col, int64_t n) {
  auto sum_at = [&](int64_t q, int64_t j) {
    if constexpr (std::is_same_v<Sum, int32_t>) return vcvt(vsub32(vload_i32(sums[q] + j), vload_i32(colsum + j)));
    else return vload(sums[q] + j);
  };
  auto scale_at = [&](int64_t q, vf ws) { return xscale != nullptr ? vmul(vbroadcast(xscale + q), ws) : ws; };
  if (col + 32 > n) {
    for (int64_t q = 0; q < rows; ++q)
      for (int64_t j = 0; j < 32 && col + j < n; j += kLanes)
        store_row(sum_at(q, j), scale_at(q, vload(wscale + j)), bias, y + q * ldy, col + j, n);
    return;
  }
  const vf ws0 = vload(wscale), ws1 = vload(wscale + kLanes);
  const bool biased = bias != nullptr;
  const vf b0 = biased ? vload(bias + col) : vzero(), b1 = biased ? vload(bias + col + kLanes) : vzero();
  // the high halves of the 32 rounded lanes (bfloat16 bits), first vector's then the second's
  const __m512i high_halves = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                               31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int64_t q = 0; q < rows; ++q) {
    const vf v0 = vfma(sum_at(q, 0), scale_at(q, ws0), b0), v1 = vfma(sum_at(q, kLanes), scale_at(q, ws1), b1);
    _mm512_storeu_si512(y + q * ldy + col, _mm512_permutex2var_epi16(infer::bf16_round_bits(v0), high_halves,
                                                                     infer::bf16_round_bits(v1)));
  }
}
#endif

// 8-bit weights widened to float32: int8 codes (W8A16) or fp8 e4m3 bytes (FP8)
template <bool FP8>
inline vf widen8(const int8_t* p) {
  if constexpr (FP8) return widen_e4m3(p);
  else return widen_i8(p);
}

// W8A16's and FP8's tiles widen every weight they load (kernels/csrc/prefetch.h: a decoding kernel)
inline void prefetch(const int8_t* p) { infer::prefetch_ahead<infer::kDecodingPrefetchBytes>(p); }
// W8A8's multiply its words as loaded (a plain kernel)
inline void prefetch_words(const int8_t* p) { infer::prefetch_ahead<infer::kPlainPrefetchBytes>(p); }

// ---------------------------------------------------------------------------- W8A16 and FP8

// A row's output scale: the column scales, times the row's own scale where it has one (FP8)
inline vf row_scale(vf colscale, const float* xscale, int r) {
  return xscale == nullptr ? colscale : vmul(vbroadcast(xscale + r), colscale);  // x_scale * w_scale
}

// y[0:ROWS, cols c0 .. c0 + V kLanes of the block] for x in float32 (K floats a row); the block is
// `width` columns wide, its first column n0; scale: the block's column scales; xscale: the rows' scales
// (FP8's per-token scales, nullptr for W8A16), multiplied into the column scales as x_scale * w_scale.
template <bool FP8, int ROWS, int V>
inline void tile16(const float* xf, int64_t k, const int8_t* block, int64_t width, int64_t c0, const float* scale,
                   const float* xscale, const float* bias, uint16_t* y, int64_t ldy, int64_t n0, int64_t n) {
  vf acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = vzero();
  const int8_t* w = block + c0;
  for (int64_t i = 0; i < k; ++i, w += width) {
    prefetch(w);
    vf xb[ROWS];
    for (int r = 0; r < ROWS; ++r) xb[r] = vbroadcast(xf + r * k + i);
    for (int j = 0; j < V; ++j) {  // one widened vector live at a time: V x ROWS sums fill the registers
      const vf wv = widen8<FP8>(w + j * kLanes);
      for (int r = 0; r < ROWS; ++r) acc[r][j] = vfma(xb[r], wv, acc[r][j]);
    }
  }
  // the sums leave their registers once, in fully unrolled loops: indexed by a loop GCC does not unroll, acc
  // lived in memory, stored at every k, which halved a prompt chunk's speed
  alignas(64) float out[ROWS][V][kLanes];
#pragma GCC unroll 64
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) vstore(out[r][j], acc[r][j]);
  for (int j = 0; j < V; ++j) {
    const int64_t col = n0 + c0 + j * kLanes;
    const vf s = vload(scale + c0 + j * kLanes);
    for (int r = 0; r < ROWS; ++r)
      if (col < n) store_row(vload(out[r][j]), row_scale(s, xscale, r), bias, y + r * ldy, col, n);
  }
}

// y[0:ROWS, VS vectors of columns from col0] for x in float32 against wf, the weights already widened to float32
// (K rows, ldw floats apart, from the slice's first column); scale: the slice's column scales.
template <int ROWS, int VS>
inline void tile16_widened(const float* xf, int64_t k, const float* wf, int64_t ldw, const float* scale,
                           const float* xscale, const float* bias, uint16_t* y, int64_t ldy, int64_t col0, int64_t n) {
  vf acc[ROWS][VS];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < VS; ++j) acc[r][j] = vzero();
  for (int64_t i = 0; i < k; ++i) {
    vf w[VS];
    for (int j = 0; j < VS; ++j) w[j] = vload(wf + i * ldw + j * kLanes);
    for (int r = 0; r < ROWS; ++r) {
      const vf xb = vbroadcast(xf + r * k + i);
      for (int j = 0; j < VS; ++j) acc[r][j] = vfma(xb, w[j], acc[r][j]);
    }
  }
  alignas(64) float out[ROWS][VS][kLanes];  // (as tile16)
#pragma GCC unroll 64
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < VS; ++j) vstore(out[r][j], acc[r][j]);
  for (int j = 0; j < VS; ++j) {
    const int64_t col = col0 + j * kLanes;
    const vf s = vload(scale + j * kLanes);
    for (int r = 0; r < ROWS; ++r)
      if (col < n) store_row(vload(out[r][j]), row_scale(s, xscale, r), bias, y + r * ldy, col, n);
  }
}

// Rows a W8A16 / FP8 work item, each item widening its block (or its slices) first: the other kernels' 48 widened
// each block of a 256-token prompt 6 times (W8A16 0.90x bfloat16's rate on Zen 5, 128 rows 0.93x, 256 0.95-0.97x)
constexpr int64_t kWidenedRowChunk = 256;

#if defined(__AVX512BF16__)
// A prompt chunk on AVX-512 BF16: each block widened once to bfloat16 pairs (exact: every int8 and
// every e4m3 value is a bfloat16 value), then tiles of rows that do nothing but vdpbf16ps, two products a lane
// an instruction against bfloat16 x pairs (W8A16: x itself; FP8: its e4m3 codes, exact in bfloat16), exact
// products, float32 sums (tiles of 24 sums: 6 rows x 64 columns, 12 x 32, as bf16_linear.cpp's). Float32 FMA on
// widened weights reached 0.43x of the bfloat16 linears' prefill on Zen 5.
constexpr bool kPairs = true;

// Where a block's widened pairs put pair p's 16 words of columns 16 g .. 16 g + 15: [K/2][width] words in order
// (vdpbf16ps's vectors), or tiled, [K/32][width/16][16 pairs][16 columns] (AMX B tiles, each a contiguous 1 KiB:
// read as 16 pairs x 64 bytes at the block's row stride, a 256 x 576 x 3072 FP8 call took 1.2x as long)
inline int64_t pair_words(int64_t p, int64_t g, int64_t width, bool tiled) {
  return tiled ? ((p / 16 * (width / 16) + g) * 16 + p % 16) * 16 : p * width + 16 * g;
}

// the block's weights ([K][width] codes) widened to bfloat16 pairs, laid out as pair_words says
template <bool FP8>
inline void widen_block_pairs(const int8_t* block, int64_t k, int64_t width, int32_t* wp, bool tiled) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < k / 2; ++p)
    for (int64_t c = 0; c < width; c += 16) {
      const vf even = widen8<FP8>(block + 2 * p * width + c), odd = widen8<FP8>(block + (2 * p + 1) * width + c);
      _mm512_storeu_si512(wp + pair_words(p, c / 16, width, tiled),
                          _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(even), 16),
                                          _mm512_and_si512(_mm512_castps_si512(odd), high)));
    }
}

// y[0:ROWS, the block's V x 16 columns from col0] against its widened pairs (V x 16 words a pair)
template <int ROWS, int V>
inline void tile_pairs(const uint16_t* xh, int64_t ldh, int64_t pairs, const int32_t* wp, const float* scale,
                       const float* xscale, const float* bias, uint16_t* y, int64_t ldy, int64_t col0, int64_t n) {
  __m512 acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[V];
    for (int j = 0; j < V; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wp + (p * V + j) * 16);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, xh + r * ldh + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < V; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
    }
  }
  alignas(64) float out[ROWS][V][16];  // (as tile16)
#pragma GCC unroll 64
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) vstore(out[r][j], acc[r][j]);
  for (int j = 0; j < V; ++j) {
    const int64_t col = col0 + 16 * j;
    const vf s = vload(scale + 16 * j);
    for (int r = 0; r < ROWS; ++r)
      if (col < n) store_row(vload(out[r][j]), row_scale(s, xscale, r), bias, y + r * ldy, col, n);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The pairs on AMX tiles (the `amx` class; tdpbf16ps): the block widened as for vdpbf16ps, tiled (pair_words), and
// the rows' bfloat16 pairs as A tiles: the same exact products, summed in float32 in the tiles' order. Per 32
// columns, per 32 rows: C tiles 0-3 (2 x 2), A 4-5, B 6-7; a group's outputs are written under the next group's
// products. xh: rows on cache lines (ldh x 2 bytes a multiple of 64), readable for 32 rows past r1 (rows past r1
// are never stored); pairs a multiple of 16.
template <int V>
void amx_rows_of_pairs(const uint16_t* xh, int64_t ldh, int64_t pairs, const int32_t* wp, const float* scale,
                       const float* xscale, const float* bias, uint16_t* y, int64_t n0, int64_t n, int64_t r,
                       int64_t r1) {
  constexpr int64_t width = V * 16;
  infer::configure_tiles();
  const int64_t kblocks = pairs / 16, lda = ldh * 2;
  alignas(64) float out[2][32][32];
  int64_t group = 0, last_row = 0, last_c0 = 0;  // the previous group's outputs are written under this one's products
  auto write = [&](int64_t g, int64_t row, int64_t c) {
    store_group<float>(out[g & 1], std::min<int64_t>(32, r1 - row), xscale != nullptr ? xscale + row : nullptr,
                       scale + c, nullptr, bias, y + row * n, n, n0 + c, n);
  };
  for (int64_t c0 = 0; c0 < width && n0 + c0 < n; c0 += 32) {
    for (int64_t i = r; i < r1; i += 32, ++group) {
      const bool two = i + 16 < r1;
      infer::zero_accumulators(two);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        const int32_t* w = wp + pair_words(16 * kb, c0 / 16, width, true);
        infer::tile_step<false>(xh + i * ldh + kb * 32, lda, w, w + 256, 64, two);
      }
      if (group > 0) write(group - 1, last_row, last_c0);
      infer::store_accumulators(out[group & 1], two);
      last_row = i;
      last_c0 = c0;
    }
  }
  if (group > 0) write(group - 1, last_row, last_c0);
  _tile_release();
}
#endif

// rows r .. r1 of a block already widened to bfloat16 pairs (wp), in tiles of 24 sums, then pairs and single rows;
// xscale: the rows' scales (FP8) or nullptr (W8A16). tiles: on AMX tiles (xh as amx_rows_of_pairs takes it).
template <int V>
inline void rows_of_pairs(const uint16_t* xh, int64_t ldh, int64_t pairs, const int32_t* wp, const float* scale,
                          const float* xscale, const float* bias, uint16_t* y, int64_t n0, int64_t n, int64_t r,
                          int64_t r1, bool tiles) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (tiles) return amx_rows_of_pairs<V>(xh, ldh, pairs, wp, scale, xscale, bias, y, n0, n, r, r1);
#endif
  auto xs = [&](int64_t row) { return xscale ? xscale + row : nullptr; };
  constexpr int rows = 24 / V;
  int64_t i = r;
  for (; i + rows <= r1; i += rows)
    tile_pairs<rows, V>(xh + i * ldh, ldh, pairs, wp, scale, xs(i), bias, y + i * n, n, n0, n);
  for (; i + 2 <= r1; i += 2) tile_pairs<2, V>(xh + i * ldh, ldh, pairs, wp, scale, xs(i), bias, y + i * n, n, n0, n);
  for (; i < r1; ++i) tile_pairs<1, V>(xh + i * ldh, ldh, pairs, wp, scale, xs(i), bias, y + i * n, n, n0, n);
}
#else
constexpr bool kPairs = false;
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// FP8 on AVX-512 BF16 with VBMI: every e4m3 value is a bfloat16 value, so each weight byte is looked up as the
// two bytes of its bfloat16 (two vpermi2b on 128-entry tables indexed by the byte's low 7 bits, the sign bit
// OR-ed back into the high byte), the halves interleaved into (k, k + 1) pairs, and vdpbf16ps multiplies the pairs
// against the row's e4m3 codes as bfloat16 pairs: 5 instructions decode 64 weights, where widening to float32
// for FMA takes 5 for 16. The products are exact in float32 and summed in float32, as on the FMA path (in
// another order). The weight is packed for it ([blocks][K/2][W][2], kernels/int8_linear.py): each 64-byte
// chunk holds 32 columns' pairs, column j < 16 at pair slot 8 (j / 4) + j % 4 and column 16 + j at
// 8 (j / 4) + 4 + j % 4, so that the in-lane byte interleave (vpunpcklbw / vpunpckhbw) leaves columns 0-15 and
// 16-31 in order.
constexpr bool kFp8Table = true;

struct E4m3Tables {  // high and low bytes of the bfloat16 each positive e4m3 code (0 .. 0x7E) stands for
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
  E4m3Tables() {
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3, m = c & 7;
      const float v = c == 0x7F ? 0.f : e > 0 ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);  // at most 4 significant bits: the top 16 bits are the value exactly
      high[c] = static_cast<uint8_t>(bits >> 24);
      low[c] = static_cast<uint8_t>(bits >> 16);
    }
  }
};

struct E4m3Decoder {
  __m512i high0, high1, low0, low1, sign;
  E4m3Decoder() {
    static const E4m3Tables t;
    high0 = _mm512_load_si512(t.high);
    high1 = _mm512_load_si512(t.high + 64);
    low0 = _mm512_load_si512(t.low);
    low1 = _mm512_load_si512(t.low + 64);
    sign = _mm512_set1_epi8(static_cast<char>(0x80));
  }
  // 64 bytes (32 columns' (k, k + 1) pairs, in the packed slot order) -> the pairs of columns 0-15 and 16-31
  INFER_INLINE void pairs(const uint8_t* p, __m512i& first, __m512i& second) const {
    const __m512i b = _mm512_loadu_si512(p);
    const __m512i h = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(high0, b, high1), b, sign, 0xF8);  // h | b & 0x80
    const __m512i l = _mm512_permutex2var_epi8(low0, b, low1);
    first = _mm512_unpacklo_epi8(l, h);
    second = _mm512_unpackhi_epi8(l, h);
  }
};

// y[0:ROWS, the block's V x 16 columns from n0] for rows of e4m3 codes as bfloat16 pairs (ldh apart), decoding
// the block's bytes in registers: a decode step's few rows. Two sums a row and vector (even and odd pairs), so
// that vdpbf16ps's latency does not leave a single row waiting.
template <int ROWS, int V>
inline void tile_fp8(const uint16_t* xh, int64_t ldh, int64_t pairs, const uint8_t* block, const E4m3Decoder& d,
                     const float* scale, const float* xscale, const float* bias, uint16_t* y, int64_t ldy, int64_t n0,
                     int64_t n) {
  constexpr int64_t row_bytes = V * 32;  // one pair of k for the block's V x 16 columns
  __m512 acc[2][ROWS][V];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < V; ++j) acc[h][r][j] = _mm512_setzero_ps();
  auto pair_step = [&](int h, int64_t p) __attribute__((always_inline)) {
    const uint8_t* w = block + p * row_bytes;
    prefetch(reinterpret_cast<const int8_t*>(w));
    if (row_bytes > 64) prefetch(reinterpret_cast<const int8_t*>(w + 64));
    __m512i wv[V];
    for (int c = 0; c < V / 2; ++c) d.pairs(w + 64 * c, wv[2 * c], wv[2 * c + 1]);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, xh + r * ldh + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < V; ++j) acc[h][r][j] = _mm512_dpbf16_ps(acc[h][r][j], (__m512bh)wv[j], xv);
    }
  };
  int64_t p = 0;
  for (; p + 2 <= pairs; p += 2) {
    pair_step(0, p);
    pair_step(1, p + 1);
  }
  if (p < pairs) pair_step(0, p);
  for (int j = 0; j < V; ++j) {
    const int64_t col = n0 + 16 * j;
    const vf s = vload(scale + 16 * j);
    for (int r = 0; r < ROWS; ++r)
      if (col < n) store_row(_mm512_add_ps(acc[0][r][j], acc[1][r][j]), row_scale(s, xscale, r), bias, y + r * ldy, col, n);
  }
}

// the block's bytes decoded to bfloat16 pairs, [K/2][width] 32-bit words in column order, for tile_pairs
template <int V>
inline void widen_block_fp8(const uint8_t* block, int64_t pairs, const E4m3Decoder& d, int32_t* wp, bool tiled) {
  constexpr int64_t row_bytes = V * 32;
  for (int64_t p = 0; p < pairs; ++p)
    for (int c = 0; c < V / 2; ++c) {
      __m512i first, second;
      d.pairs(block + p * row_bytes + 64 * c, first, second);
      _mm512_storeu_si512(wp + pair_words(p, 2 * c, V * 16, tiled), first);
      _mm512_storeu_si512(wp + pair_words(p, 2 * c + 1, V * 16, tiled), second);
    }
}

// Rows r .. r1 of one FP8 block in the pairs layout: decoded in registers for a few rows, else decoded once into
// pairs (in cache) that tile_pairs' tiles read, as W8A16's prompt chunks do
template <int V>
inline void rows_of_block_fp8(const uint16_t* xh, int64_t ldh, int64_t pairs, const uint8_t* block, const float* scale,
                              const float* xscale, const float* bias, uint16_t* y, int64_t n0, int64_t n, int64_t r,
                              int64_t r1, bool tiles) {
  const E4m3Decoder d;
  if (r1 - r < 8) {
    for (; r + 2 <= r1; r += 2)
      tile_fp8<2, V>(xh + r * ldh, ldh, pairs, block, d, scale, xscale + r, bias, y + r * n, n, n0, n);
    if (r < r1) tile_fp8<1, V>(xh + r * ldh, ldh, pairs, block, d, scale, xscale + r, bias, y + r * n, n, n0, n);
    return;
  }
  thread_local std::vector<int32_t> wp;
  wp.resize(pairs * V * 16);
  widen_block_fp8<V>(block, pairs, d, wp.data(), tiles);
  rows_of_pairs<V>(xh, ldh, pairs, wp.data(), scale, xscale, bias, y, n0, n, r, r1, tiles);
}
#else
constexpr bool kFp8Table = false;
#endif

// xh: the rows as bfloat16 pairs (ldh apart) where a prompt chunk runs on vdpbf16ps (kPairs), else nullptr
template <bool FP8, int V>  // vectors a block row: width / kLanes
inline void rows_of_block16(const float* xf, const uint16_t* xh, int64_t ldh, int64_t k, const int8_t* block,
                            const float* scale, const float* xscale, const float* bias, uint16_t* y, int64_t n0,
                            int64_t n, int64_t r, int64_t r1, bool tiles) {
  constexpr int64_t width = V * kLanes;
  auto xs = [&](int64_t row) { return xscale ? xscale + row : nullptr; };
#if defined(__AVX512BF16__)
  if (xh != nullptr) {
    thread_local std::vector<int32_t> wp;
    wp.resize(k / 2 * width);
    widen_block_pairs<FP8>(block, k, width, wp.data(), tiles);
    rows_of_pairs<V>(xh, ldh, k / 2, wp.data(), scale, xscale, bias, y, n0, n, r, r1, tiles);
    return;
  }
#endif
  constexpr int kTileRows = kLanes == 16 ? 8 : 4;  // 2 x rows accumulators, of 32 or 16 registers
  if (r1 - r < kTileRows) {
    for (; r < r1; ++r)
      tile16<FP8, 1, V>(xf + r * k, k, block, width, 0, scale, xs(r), bias, y + r * n, n, n0, n);
    return;
  }
  // Many rows (a prompt chunk): the block widened to float32 once (K x width floats, in cache), then tiles that
  // do nothing but FMA: widening in every tile took as many instructions as its FMAs (a 256-token prefill 0.68x
  // bfloat16's on Zen 3 before). Tiles as bf16_linear.cpp's widened ones: AVX-512 6 rows x 64 columns or 12 x 32
  // (24 sums), AVX2 6 x 16 (12 sums); 8 x 32 and 4 x 16 ran W8A16 prefill 0.75x the bfloat16 model's on avx2.
  constexpr int VS = kLanes == 16 ? V : 2;          // vectors a tile
  constexpr int kWideRows = kLanes == 16 ? 24 / VS : 6;
  thread_local std::vector<float> wf;
  wf.resize(k * width);
  for (int64_t i = 0; i < k; ++i)
    for (int j = 0; j < V; ++j) vstore(wf.data() + i * width + j * kLanes, widen8<FP8>(block + i * width + j * kLanes));
  for (int64_t c0 = 0; c0 < width; c0 += VS * kLanes) {
    const float* s = scale + c0;
    const float* w = wf.data() + c0;
    const int64_t col0 = n0 + c0;
    int64_t i = r;
    for (; i + kWideRows <= r1; i += kWideRows)
      tile16_widened<kWideRows, VS>(xf + i * k, k, w, width, s, xs(i), bias, y + i * n, n, col0, n);
    for (; i + 2 <= r1; i += 2) tile16_widened<2, VS>(xf + i * k, k, w, width, s, xs(i), bias, y + i * n, n, col0, n);
    for (; i < r1; ++i) tile16_widened<1, VS>(xf + i * k, k, w, width, s, xs(i), bias, y + i * n, n, col0, n);
  }
}

// ---------------------------------------------------------------------------- W8A8

struct W8A8Args {
  const int32_t* xw;    // per row, K/4 words: without VNNI the (k, k+2) int16 pair then the (k+1, k+3) pair
                        // (2 words a k quad); with VNNI the 4 codes + 128 as bytes (1 word)
  int64_t xwords;       // words a row
  const float* xscale;  // [M]
  const int8_t* w;      // [blocks][K/4][W][4]
  const float* scale;   // [blocks * W]
  const int32_t* colsum;  // [blocks * W]: 128 x sum_k w (VNNI's offset)
  const float* bias;
  uint16_t* y;
  int64_t n, quads, width;
};

// y[row, col .. col + kLanes) from the row's int32 sums there (VNNI's and AMX's alike): (sums - 128 x colsum) as
// float32, times x_scale * w_scale (as torch multiplies them), plus the bias, rounded once to bfloat16
INFER_INLINE void store_sums8(const W8A8Args& a, const int32_t* sums, int64_t row, int64_t col) {
  const vi offset = kVnni ? vload_i32(a.colsum + col) : vizero();
  const vf s = vmul(vbroadcast(a.xscale + row), vload(a.scale + col));
  store_row(vcvt(vsub32(vload_i32(sums), offset)), s, a.bias, a.y + row * a.n, col, a.n);
}

template <int ROWS, int V>
inline void tile8(const W8A8Args& a, int64_t blk, int64_t c0, int64_t r0) {
  vi acc[ROWS][V];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = vizero();
  const int8_t* w = a.w + (blk * a.quads * a.width + c0) * 4;
  const int64_t step = 4 * a.width;
  for (int64_t q = 0; q < a.quads; ++q, w += step) {
    prefetch_words(w);
    if (V * kLanes * 4 > 64) prefetch_words(w + 64);
    if (V * kLanes * 4 > 128) {
      prefetch_words(w + 128);
      prefetch_words(w + 192);
    }
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
    for (int j = 0; j < V; ++j) {
      const vi wv = vload_words(w + 4 * kLanes * j);
      for (int r = 0; r < ROWS; ++r) acc[r][j] = dot4(acc[r][j], vwords(a.xw[(r0 + r) * a.xwords + q]), wv);
    }
#else
    for (int j = 0; j < V; ++j) {
      const vi wv = vload_words(w + 4 * kLanes * j);
      const vi lo = even_pairs(wv), hi = odd_pairs(wv);
      for (int r = 0; r < ROWS; ++r) {
        const int32_t* xr = a.xw + (r0 + r) * a.xwords + 2 * q;
        acc[r][j] = vadd32(acc[r][j], vadd32(madd16(lo, vwords(xr[0])), madd16(hi, vwords(xr[1]))));
      }
    }
#endif
  }
  alignas(64) int32_t out[ROWS][V][kLanes];  // (as tile16)
#pragma GCC unroll 64
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < V; ++j) vstore_i32(out[r][j], acc[r][j]);
  for (int j = 0; j < V; ++j) {
    const int64_t col = blk * a.width + c0 + j * kLanes;
    if (col < a.n)
      for (int r = 0; r < ROWS; ++r) store_sums8(a, out[r][j], r0 + r, col);
  }
}

template <int V>
inline void rows_of_block8(const W8A8Args& a, int64_t blk, int64_t r, int64_t r1) {
  // rows a prompt tile: 2 x rows int32 sums (12 rows, 24 sums, measured slower with VNNI on Zen 5)
  constexpr int kTileRows = kLanes == 16 ? 8 : 4;
  if (r1 - r < kTileRows) {
    for (; r < r1; ++r) tile8<1, V>(a, blk, 0, r);
    return;
  }
  for (int64_t c0 = 0; c0 < V * kLanes; c0 += 2 * kLanes) {
    int64_t i = r;
    for (; i + kTileRows <= r1; i += kTileRows) tile8<kTileRows, 2>(a, blk, c0, i);
    for (; i + 2 <= r1; i += 2) tile8<2, 2>(a, blk, c0, i);
    for (; i < r1; ++i) tile8<1, 2>(a, blk, c0, i);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// W8A8 on AMX-INT8 (tdpbusd), for prompt chunks where the build targets AMX (the `amx` class): the same packed
// weights and the same offset codes as vpdpbusd, since an A tile is 16 rows of 64 unsigned bytes (a row's codes
// + 128, k in order) and a B tile 16 quads of 16 columns' 4 signed bytes, which is [K/4][W][4] read 64 bytes a
// quad at a stride of 4 W. Sums are exact int32 as with VNNI; the epilogue is tile8's, so both give the same bits.
constexpr int64_t kAmxMinRows = 16;  // fewer rows (a decode step) stream on VNNI: they are bandwidth-bound
constexpr int64_t kAmxRowBlockBytes = 512 << 10;  // rows of codes worked on together: kept in L2


// Rows r .. r1 of one block on tiles: per 32 output columns, per 32 rows, C tiles 0-3 (2 row x 2 column tiles),
// A tiles 4-5 (rows of codes), B tiles 6-7 (weights). xu: the rows' codes + 128, ldx bytes apart, readable for 32
// rows past r1 (the buffer is padded) so a partial row tile loads; rows past r1 are never stored.
template <int V>
void amx_rows_of_block8(const W8A8Args& a, const uint8_t* xu, int64_t ldx, int64_t blk, int64_t r, int64_t r1) {
  constexpr int64_t kCols = V * kLanes;
  infer::configure_tiles();
  const int64_t ldw = 4 * a.width, kblocks = a.quads / 16;
  const int8_t* wb = a.w + blk * a.quads * ldw;
  alignas(64) int32_t out[32][32];
  for (int64_t c0 = 0; c0 < kCols; c0 += 32) {
    for (int64_t i = r; i < r1; i += 32) {
      const bool two = i + 16 < r1;
      infer::zero_accumulators(two);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        const int8_t* w = wb + kb * 16 * ldw + c0 * 4;
        infer::tile_step<true>(xu + i * ldx + kb * 64, ldx, w, w + 64, ldw, two);
      }
      infer::store_accumulators(out, two);
      const int64_t col = blk * a.width + c0;
      store_group<int32_t>(out, std::min<int64_t>(32, r1 - i), a.xscale + i, a.scale + col, a.colsum + col, a.bias,
                           a.y + i * a.n, a.n, col, a.n);
    }
  }
  _tile_release();
}
#endif

}  // namespace

namespace {

// Whether a W8A16 / FP8 call of m rows and this many k pairs runs its bfloat16 pairs on AMX tiles: a prompt chunk
// (16 rows or more; fewer stream on vdpbf16ps, bandwidth-bound), whole tiles of k, where the build targets AMX
inline bool amx_pairs(int64_t m, int64_t pairs) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return m >= 16 && pairs % 16 == 0 && infer::amx_granted();
#else
  (void)m;
  (void)pairs;
  return false;
#endif
}

// Each scheme's tile condition for a call of m rows and K k, stated once: the kernels branch on it and Python names
// a linear's kernel from it (the module's prompt_tiles). W8A16 reads x's rows as bfloat16 pairs (K even); FP8
// decoded by table (kFp8Table) pads K to whole pairs; W8A8 on AMX-INT8 takes K in whole 64-byte tile rows.
inline bool w8a16_tiles(int64_t m, int64_t k) { return kPairs && k % 2 == 0 && amx_pairs(m, k / 2); }
inline bool fp8_tiles(int64_t m, int64_t k) { return kFp8Table ? amx_pairs(m, (k + 1) / 2) : w8a16_tiles(m, k); }
inline bool w8a8_tiles(int64_t m, int64_t k) {
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  return m >= kAmxMinRows && k % 64 == 0 && infer::amx_granted();
#else
  (void)m;
  (void)k;
  return false;
#endif
}

// fn(block, first row, end row) for a W8A16 / FP8 call: on AMX tiles (`tiles`), a contiguous run of blocks a thread
// (for_column_runs; work items from a shared counter took 1.07x as long for FP8 at 256 x 3072 x 576 on the Xeon `amx`
// host, medians of 5 interleaved rounds: 708 against 662 us); otherwise for_blocks_and_rows' work items.
template <typename Fn>
void for_tile_blocks(int64_t m, int64_t blocks, bool tiles, const Fn& fn) {
  if (tiles) return infer::for_column_runs(m, blocks, kWidenedRowChunk, fn);
  infer::for_blocks_and_rows(m, blocks, fn, m >= 8 ? kWidenedRowChunk : infer::kRowChunk);
}

// W8A16 (xscale empty: x as it is) and FP8 (x's rows quantized to e4m3 first) over the [blocks, K, W] layout
template <bool FP8>
torch::Tensor linear8(const Int8Inputs& in, const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  const int64_t m = in.m, k = in.k, width = in.width;
  // What the tiles read of x, prepared once per row with plain loops (a torch op's dispatch would cost a decode
  // step's small linears), over the threads for a prompt chunk: a prompt chunk on vdpbf16ps reads bfloat16
  // pairs (W8A16: x as it is; FP8: its codes), the other tiles float32 (x widened, or its codes)
  const bool pairs = kPairs && m >= 8 && k % 2 == 0;
  // AMX tiles (prompt chunks of 16 rows or more, K a multiple of 32) read the pairs from rows on cache lines,
  // readable for 32 rows past the last: copied so (W8A16; FP8's codes are written so)
  const bool tiles = pairs && (FP8 ? fp8_tiles(m, k) : w8a16_tiles(m, k));
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t ldx = x.stride(0);
  float* xf = infer::call_buffer<float>(pairs ? 0 : m * k);
  float* xscale = infer::call_buffer<float, 1>(FP8 ? m : 0);
  uint16_t* xcodes = infer::align_up(infer::call_buffer<uint16_t>(pairs && (FP8 || tiles) ? (m + 32) * k + 32 : 0), 64);
  for_rows(m, k, [&](int64_t r) {
    if constexpr (FP8) {
      if (pairs) {
#if defined(__AVX512BF16__)
        xscale[r] = quantize_row<true>(xb + r * ldx, k, xcodes + r * k);
#endif
      } else {
        xscale[r] = quantize_row<true>(xb + r * ldx, k, xf + r * k);
      }
    } else if (tiles) {
      std::memcpy(xcodes + r * k, xb + r * ldx, k * 2);
    } else if (!pairs) {
      widen_row(xb + r * ldx, k, xf + r * k);
    }
  });
  const uint16_t* xh = !pairs ? nullptr : FP8 || tiles ? xcodes : xb;
  const int64_t ldh = FP8 || tiles ? k : ldx;
  auto y = torch::empty({m, n}, x.options());
  const float* xp = xf;
  const float* xs = FP8 ? xscale : nullptr;
  const auto* wp = reinterpret_cast<const int8_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  for_tile_blocks(m, in.blocks, tiles, [&](int64_t blk, int64_t r, int64_t r1) {
    const int8_t* w = wp + blk * k * width;
    const float* s = in.scale + blk * width;
    if (width == 64)
      rows_of_block16<FP8, 64 / kLanes>(xp, xh, ldh, k, w, s, xs, in.bias, yp, blk * width, n, r, r1, tiles);
    else
      rows_of_block16<FP8, 32 / kLanes>(xp, xh, ldh, k, w, s, xs, in.bias, yp, blk * width, n, r, r1, tiles);
  });
  return y;
}

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
// FP8 over the pairs layout ([blocks, K/2, W, 2], K padded to even): each row's e4m3 codes as bfloat16, padded with
// a zero code, then rows_of_block_fp8
torch::Tensor fp8_pairs_linear(const Int8Inputs& in, const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  const int64_t m = in.m, k = in.k, width = in.width, pairs = packed.size(1), kp = 2 * pairs;
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t ldx = x.stride(0);
  float* xscale = infer::call_buffer<float>(m);
  const bool tiles = fp8_tiles(m, k);  // (the codes' rows on cache lines, 32 rows past the last readable)
  uint16_t* xcodes = infer::align_up(infer::call_buffer<uint16_t>((m + 32) * kp + 32), 64);
  for_rows(m, k, [&](int64_t r) {
    xscale[r] = quantize_row<true>(xb + r * ldx, k, xcodes + r * kp);
    if (kp > k) xcodes[r * kp + k] = 0;
  });
  auto y = torch::empty({m, n}, x.options());
  const auto* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  for_tile_blocks(m, in.blocks, tiles, [&](int64_t blk, int64_t r, int64_t r1) {
    const uint8_t* w = wp + blk * kp * width;
    const float* s = in.scale + blk * width;
    if (width == 64)
      rows_of_block_fp8<4>(xcodes, kp, pairs, w, s, xscale, in.bias, yp, blk * width, n, r, r1, tiles);
    else
      rows_of_block_fp8<2>(xcodes, kp, pairs, w, s, xscale, in.bias, yp, blk * width, n, r, r1, tiles);
  });
  return y;
}
#endif

}  // namespace

// x: [M, K] bfloat16 with contiguous rows; packed: [ceil(N/W), K, W] int8, scales: float32 [ceil(N/W) W]
// (kernels/int8_linear.py); bias: float32 [N] or None. Returns [M, N] bfloat16.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n,
                          c10::optional<torch::Tensor> bias) {
  return linear8<false>(check_int8_inputs("int8_linear", x, packed, scales, n, bias, 3), x, packed, n);
}

// x: [M, K] bfloat16 with contiguous rows, quantized here per token to e4m3; packed: [ceil(N/W), K, W] uint8
// holding e4m3 bytes, scales: float32 [ceil(N/W) W] (kernels/int8_linear.py); bias: float32 [N] or None.
// Returns [M, N] bfloat16.
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t n,
                         c10::optional<torch::Tensor> bias) {
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
  return fp8_pairs_linear(check_int8_inputs("fp8_linear", x, packed, scales, n, bias, 4, at::kByte, 2), x, packed, n);
#else
  return linear8<true>(check_int8_inputs("fp8_linear", x, packed, scales, n, bias, 3, at::kByte), x, packed, n);
#endif
}

// x: [M, K] bfloat16 with contiguous rows, quantized here per token; packed: [ceil(N/W), K/4, W, 4] int8,
// scales: float32 [ceil(N/W) W], colsums: int32 [ceil(N/W) W], 128 x each column's sum of codes
// (kernels/int8_linear.py); bias: float32 [N] or None. Returns [M, N] bfloat16.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor colsums,
                          int64_t n, c10::optional<torch::Tensor> bias) {
  const Int8Inputs in = check_int8_inputs("w8a8_linear", x, packed, scales, n, bias, 4);
  TORCH_CHECK(colsums.scalar_type() == at::kInt && colsums.is_contiguous() && colsums.numel() == scales.numel(),
              "w8a8_linear: colsums must be int32 of the scales' shape (kernels/int8_linear.py)");
  const int64_t m = in.m, k = in.k, quads = k / 4;
  // each row's codes, laid out as the tiles broadcast them
  const int64_t xwords = kVnni ? quads : 2 * quads;
  const bool tiles = w8a8_tiles(m, k);
  const int64_t padded = tiles ? m + 32 : m;  // a partial row tile reads past the last row
  // on a cache line: an AMX tile row (64 bytes of a row's codes) split over two lines loads at a third of the speed
  int32_t* xw = infer::align_up(infer::call_buffer<int32_t>(padded * xwords + 16), 64);
  float* xscale = infer::call_buffer<float>(m);
  const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
  for_rows(m, k, [&](int64_t r) {
    int32_t* out = xw + r * xwords;
    if (kVnni) {  // the codes + 128 as bytes, 4 consecutive k a word (flipping each byte's top bit after
                  // quantizing, a byte at a time, took 70% of a prompt chunk's quantization)
      xscale[r] = quantize_row<false, int8_t, true>(xb + r * x.stride(0), k, reinterpret_cast<int8_t*>(out));
      return;
    }
    thread_local std::vector<int8_t> codes;
    codes.resize(k);
    xscale[r] = quantize_row<false>(xb + r * x.stride(0), k, codes.data());
    for (int64_t q = 0; q < quads; ++q) {  // int16 pairs (k, k+2) and (k+1, k+3), low half first
      const int8_t* c = codes.data() + 4 * q;
      out[2 * q] = static_cast<int32_t>(static_cast<uint16_t>(c[0]) | static_cast<uint32_t>(static_cast<uint16_t>(c[2])) << 16);
      out[2 * q + 1] = static_cast<int32_t>(static_cast<uint16_t>(c[1]) | static_cast<uint32_t>(static_cast<uint16_t>(c[3])) << 16);
    }
  });
  auto y = torch::empty({m, n}, x.options());
  const W8A8Args a{xw, xwords, xscale, packed.data_ptr<int8_t>(), in.scale, colsums.data_ptr<int32_t>(),
                   in.bias, reinterpret_cast<uint16_t*>(y.data_ptr()), n, quads, in.width};
#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
  if (tiles) {
    std::memset(xw + m * xwords, 128, (padded - m) * xwords * 4);  // code 0: the pad rows multiply to nothing
    const auto* xu = reinterpret_cast<const uint8_t*>(xw);
    // A contiguous run of blocks a thread over rows in runs of about kAmxRowBlockBytes of codes (for_column_runs).
    // Work items of 64 rows from a shared counter (for_blocks_and_rows) read each block's weights once per item and
    // took 1.13x as long (256 x 3072 x 576 on the Xeon `amx` host, medians of 5 interleaved rounds: 332 against 293
    // us; items of 256 rows 320).
    const int64_t ldx = 4 * xwords, rows_per_run = std::max<int64_t>(32, kAmxRowBlockBytes / ldx / 32 * 32);
    infer::for_column_runs(m, in.blocks, rows_per_run, [&](int64_t blk, int64_t r, int64_t r1) {
      if (a.width == 64)
        amx_rows_of_block8<64 / kLanes>(a, xu, ldx, blk, r, r1);
      else
        amx_rows_of_block8<32 / kLanes>(a, xu, ldx, blk, r, r1);
    });
    return y;
  }
#endif
  infer::for_blocks_and_rows(m, in.blocks, [&](int64_t blk, int64_t r, int64_t r1) {
    if (a.width == 64)
      rows_of_block8<64 / kLanes>(a, blk, r, r1);
    else
      rows_of_block8<32 / kLanes>(a, blk, r, r1);
  });
  return y;
}

bool available() { return true; }
bool has_vnni() { return kVnni; }
bool fp8_pairs() { return kFp8Table; }
// whether a prompt chunk (16 rows) of `scheme` (w8a16, fp8, w8a8) with K k runs on AMX tiles in this process
bool prompt_tiles(const std::string& scheme, int64_t k) {
  if (scheme == "w8a16") return w8a16_tiles(16, k);
  if (scheme == "fp8") return fp8_tiles(16, k);
  TORCH_CHECK(scheme == "w8a8", "prompt_tiles: scheme ", scheme, " is none of w8a16, fp8, w8a8");
  return w8a8_tiles(16, k);
}

#else

torch::Tensor int8_linear(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "int8_linear: built for a CPU without AVX2 and FMA");
}
torch::Tensor fp8_linear(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "fp8_linear: built for a CPU without AVX2 and FMA");
}
torch::Tensor w8a8_linear(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t,
                          c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "w8a8_linear: built for a CPU without AVX2 and FMA");
}
bool available() { return false; }
bool has_vnni() { return false; }
bool fp8_pairs() { return false; }
bool prompt_tiles(const std::string&, int64_t) { return false; }

#endif

#ifndef INFER_NO_MODULE  // step_layers.cpp includes this file for its kernels alone
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "W8A16: int8 per-channel weights, bfloat16 activations (CPU: AVX-512F or AVX2 + FMA)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fp8_linear", &fp8_linear,
        "FP8: e4m3 per-channel weights decoded in registers, dynamic per-token e4m3 activations, float32 sums",
        py::call_guard<py::gil_scoped_release>());
  m.def("w8a8_linear", &w8a8_linear,
        "W8A8: int8 per-channel weights, dynamic per-token int8 activations, exact int32 sums",
        py::call_guard<py::gil_scoped_release>());
  m.def("available", &available, "whether this build has the int8 kernels (its target has AVX2 + FMA at least)");
  m.def("has_vnni", &has_vnni, "whether W8A8 runs on AVX-512 VNNI (vpdpbusd) in this build");
  m.def("prompt_tiles", &prompt_tiles, py::arg("scheme"), py::arg("k"),
        "whether a prompt chunk of this scheme (w8a16, fp8, w8a8) and K runs on AMX tiles in this process "
        "(W8A8: AMX-INT8 tdpbusd; W8A16, FP8: AMX-BF16 tdpbf16ps)");
  m.def("fp8_pairs", &fp8_pairs,
        "whether FP8 weights are decoded by table to bfloat16 pairs (AVX-512 BF16 + VBMI): packed [blocks, K/2, W, 2]");
}
#endif
