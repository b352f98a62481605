// Scratch memory a kernel call needs (a prompt chunk's activation codes, its rows widened to float32), kept by
// the calling thread from one call to the next: allocated afresh, a few hundred KiB came from the OS each call
// and cost page faults (~35 us of a 256 x 576 FP8 call's ~60 us gap to W8A16 on Zen 5).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace infer {

// At least `count` T of the calling thread's buffer number Tag (distinct tags for buffers a call holds at once);
// its contents are whatever the last call left. Take the pointer before a parallel region: a thread_local named
// inside the workers' code would be each worker's own.
template <typename T, int Tag = 0>
T* call_buffer(std::size_t count) {
  thread_local std::vector<T> buffer;
  if (buffer.size() < count) buffer.resize(count);
  return buffer.data();
}

// p moved up to the next multiple of `bytes` (a buffer asked with that much to spare)
template <typename T>
T* align_up(T* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return reinterpret_cast<T*>((a + bytes - 1) / bytes * bytes);
}

}  // namespace infer
