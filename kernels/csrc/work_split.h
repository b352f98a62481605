// How work is split over the threads: a packed linear's column blocks and rows (kernels/csrc/bf16_linear.cpp,
// int4_linear.cpp, int8_linear.cpp), a prompt-chunk attention's rows and KV heads (amx_attention.cpp,
// bf16_attention.cpp): one place for each policy.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

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

// fn(block, first row, end row) over every block and all m rows, each thread a contiguous run of blocks, rows in
// runs of row_block (kept in L2 while the blocks stream past): for prompt chunks on AMX tiles, where a block's
// weights are read once a run and a thread's outputs of a row lie side by side (amx_linear.cpp splits so; the 8-bit
// tiles took 1.07-1.13x as long on for_blocks_and_rows' items, kernels/csrc/int8_linear.cpp).
template <typename Fn>
void for_column_runs(int64_t m, int64_t blocks, int64_t row_block, const Fn& fn) {
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = 0; r < m; r += row_block)
      for (int64_t blk = first; blk < last; ++blk) fn(blk, r, std::min(m, r + row_block));
  });
}

// fn(state, chunk, KV head, first row, rows) over every chunk's rows in runs of `rows_per_task`, for each KV head:
// tasks taken largest first (rows x the keys their last row sees) from a shared counter, since causal rows differ
// in cost and a static split would leave a core idle (a fresh prompt's 3 KV heads on 2 cores, one idle a third of
// the time). `state` is the worker's own: what setup() returns before its first task (a value, or a reference to
// the thread's own scratch kept from call to call).
template <typename Setup, typename Fn>
void for_chunk_tasks(int64_t chunks, const int64_t* lengths, const int64_t* cached, int64_t kv_heads,
                     int64_t rows_per_task, const Setup& setup, const Fn& fn) {
  struct Task {
    int64_t chunk, head, i0, n, cost;
  };
  std::vector<Task> tasks;
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t i0 = 0; i0 < lengths[c]; i0 += rows_per_task)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t n = std::min(rows_per_task, lengths[c] - i0);
        tasks.push_back({c, h, i0, n, n * (cached[c] + i0 + n)});
      }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(tasks.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    decltype(auto) state = setup();
    for (int64_t j = next++; j < count; j = next++) fn(state, tasks[j].chunk, tasks[j].head, tasks[j].i0, tasks[j].n);
  });
}

}  // namespace infer
