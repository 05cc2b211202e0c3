// Work sharing for the matmul kernels that walk a packing of 16-column blocks two at a time
// (amx_linear.cpp, f32_linear.cpp).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace {

// fn(first, end) on each thread's equal run of column blocks, in whole pairs.
template <typename F>
void by_column_pairs(int64_t col_blocks, F&& fn) {
  const int64_t pairs = (col_blocks + 1) / 2;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), pairs));
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      fn(2 * (pairs * t / threads), std::min(col_blocks, 2 * (pairs * (t + 1) / threads)));
  });
}

}  // namespace
