// Storage dtypes <-> float32 for the CPU kernels: they all compute in float32, whatever the
// tensors hold. Conversions back round to nearest even, as torch's do.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace infer {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline at::BFloat16 from_float<at::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // finite inputs only: activations here are never NaN
  at::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}
template <>
inline at::Half from_float<at::Half>(float f) { return static_cast<at::Half>(f); }

}  // namespace infer
