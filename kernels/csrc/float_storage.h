// Storage dtypes <-> float32 for the CPU kernels: they all compute in float32, whatever the
// tensors hold. Conversions back round to nearest even, as torch's do.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace infer {

// Forced inline: step_layers.cpp includes kernels under their own optimisation pragmas, and GCC does not
// inline a plain `inline` function across differing options (a call per element otherwise).
#define INFER_INLINE inline __attribute__((always_inline))

INFER_INLINE float to_float(float x) { return x; }
INFER_INLINE float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
INFER_INLINE float to_float(at::Half x) { return static_cast<float>(x); }

template <typename T>
T from_float(float f);
template <>
INFER_INLINE float from_float<float>(float f) { return f; }
template <>
INFER_INLINE at::BFloat16 from_float<at::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // finite inputs only: activations here are never NaN
  at::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}
template <>
INFER_INLINE at::Half from_float<at::Half>(float f) { return static_cast<at::Half>(f); }

}  // namespace infer
