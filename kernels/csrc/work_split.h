// How a packed linear's column blocks and rows are split over the threads (kernels/csrc/bf16_linear.cpp,
// int4_linear.cpp): one place for the policy.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace infer {

constexpr int64_t kRowChunk = 48;     // rows per work item of a prompt chunk (8 tiles of 6, 4 of 12)
constexpr int64_t kDynamicRows = 16;  // from this many rows on, threads take work items as they go

// fn(block, first row, end row) over every block and all m rows; row_chunk: rows a work item (more for a kernel
// that prepares each block per work item, as the 8-bit ones widen theirs).
// A decode step (few rows): each thread streams one contiguous run of blocks, which the prefetcher
// follows. A prompt chunk: work items (block, chunk of rows), block-major so a thread's next item
// mostly reuses the block it just read, taken from a shared counter rather than split in advance: a
// core the OS lends to another thread for a moment (a server's event loop, a client on the same
// host) then delays only the items it holds, not the whole call waiting for its half.
template <typename Fn>
void for_blocks_and_rows(int64_t m, int64_t blocks, const Fn& fn, int64_t row_chunk = kRowChunk) {
  if (m < kDynamicRows) {
    at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t blk = first; blk < last; ++blk) fn(blk, 0, m);
    });
    return;
  }
  const int64_t chunk_rows = std::min(m, row_chunk), chunks = (m + chunk_rows - 1) / chunk_rows;
  const int64_t items = blocks * chunks;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    for (int64_t item = next++; item < items; item = next++) {
      const int64_t blk = item / chunks, r0 = item % chunks * chunk_rows;
      fn(blk, r0, std::min(m, r0 + chunk_rows));
    }
  });
}

}  // namespace infer
