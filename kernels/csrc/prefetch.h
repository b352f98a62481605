// How far ahead of its loads a linear prefetches the weights it streams, in one place for every linear kernel
// (bf16_linear.cpp, int4_linear.cpp, int8_linear.cpp). Two kinds of kernel, measured apart (kernels/isa.py,
// prefetch_bytes(), has the figures):
// - plain ones multiply the weights as loaded (bfloat16 pairs, W8A8's int8 words): the build's setting, which
//   is 0 (no prefetch instruction, the hardware's prefetchers alone) on CPUs where that streamed faster;
// - decoding ones widen each weight first (int4 nibbles, W8A16's int8 and FP8's e4m3 bytes): 2 KiB ahead on
//   every CPU, where their slower loop leaves the hardware's prefetchers behind.
#pragma once

#include <cstdint>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef INFER_PREFETCH_BYTES
#define INFER_PREFETCH_BYTES 2048
#endif

namespace infer {

constexpr int64_t kPlainPrefetchBytes = INFER_PREFETCH_BYTES;
constexpr int64_t kDecodingPrefetchBytes = 2048;

// Asks for the cache line AHEAD bytes past p (nothing at 0)
template <int64_t AHEAD>
inline void prefetch_ahead(const void* p) {
  if constexpr (AHEAD > 0) _mm_prefetch(static_cast<const char*>(p) + AHEAD, _MM_HINT_T0);
}

}  // namespace infer
