// Prefill attention over the paged KV cache (CPU, bfloat16 cache): the op, its checks and
// its threads. The work items and their two paths are in paged_prefill.h.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "paged_prefill.h"
#include "paged_prefill_tiles.h"
#include "paged_prefill_vec.h"

namespace {

// q [T, Hq, D] bf16 (last dim contiguous; rows may be strided), kv_cache [2, num_blocks,
// block_size, Hkv, D] bf16 contiguous, with every chunk's own keys and values written.
// Chunk i owns the next query_lens[i] rows of q and sees context_lens[i] keys through
// block_tables[i]. Returns [T, Hq, D] bf16. `tiles`: the products in AMX tiles where the
// CPU allows, else in AVX512_BF16 vectors.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& query_lens,
                         const at::Tensor& context_lens, double scale, bool tiles) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_prefill runs on CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.scalar_type() == at::kBFloat16,
              "paged_prefill: q must be bf16 [T, Hq, D] with contiguous rows of a head");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == at::kBFloat16,
              "paged_prefill: kv_cache must be a contiguous bf16 [2, blocks, bs, Hkv, D]");
  const Layout l{q.size(1), kv_cache.size(3), q.size(2), kv_cache.size(2), kv_cache.size(1),
                 q.stride(0), q.stride(1)};
  TORCH_CHECK(kv_cache.size(4) == l.dim && l.heads % l.kv_heads == 0,
              "paged_prefill: q and kv_cache disagree on head_dim or the GQA group");
  TORCH_CHECK(l.dim % 32 == 0 && l.block_size % 16 == 0,
              "paged_prefill needs head_dim % 32 == 0 and block_size % 16 == 0");
  const int64_t n = query_lens.numel();
  TORCH_CHECK(query_lens.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
                  query_lens.is_contiguous() && context_lens.is_contiguous() &&
                  context_lens.numel() == n,
              "paged_prefill: query_lens and context_lens must be contiguous int64 [chunks]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == n &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "paged_prefill: block_tables must be a contiguous int64 [chunks, max_blocks]");
  std::vector<Chunk> chunks(n);
  int64_t rows = 0, values = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ql = query_lens.data_ptr<int64_t>()[i];
    const int64_t ctx = context_lens.data_ptr<int64_t>()[i];
    TORCH_CHECK(ql >= 1 && ql <= ctx && ctx <= block_tables.size(1) * l.block_size,
                "paged_prefill: chunk ", i, " has query_len ", ql, " and context ", ctx,
                " (need 1 <= query_len <= context <= its block table's capacity)");
    chunks[i] = {rows, ql, ctx, block_tables.data_ptr<int64_t>() + i * block_tables.size(1),
                 values};
    rows += ql;
    values += l.kv_heads * l.values_per_head(ctx) / 2;
  }
  TORCH_CHECK(rows == q.size(0), "paged_prefill: query_lens sum to ", rows, ", q has ",
              q.size(0), " rows");
  at::Tensor out = at::empty({rows, l.heads, l.dim}, q.options());
#ifndef PREFILL_KERNEL
  TORCH_CHECK(false, "paged_prefill: built for a CPU without AVX512_BF16");
#else
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* k_cache = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<c10::BFloat16>());
  const uint16_t* v_cache = k_cache + kv_cache.numel() / 2;
  // The values in pairs, per chunk, KV head and step of 32 keys; every word is written
  // below, so the buffer is not zeroed first.
  std::unique_ptr<uint32_t[]> pairs(new uint32_t[values]);
  std::vector<std::array<int64_t, 3>> copies;  // chunk, KV head, step
  for (int64_t i = 0; i < n; ++i)
    for (int64_t kv = 0; kv < l.kv_heads; ++kv)
      for (int64_t st = 0; st < l.steps(chunks[i].context_len); ++st) copies.push_back({i, kv, st});
  const int64_t words_per_step = l.dim * kKeys / 2;
  at::parallel_for(0, static_cast<int64_t>(copies.size()), 8, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const auto [i, kv, st] = copies[j];
      const Chunk& c = chunks[i];
      uint32_t* dst = pairs.get() + c.values +
                      (kv * l.steps(c.context_len) + st) * words_per_step;
      copy_values(l, c, v_cache, kv, st, dst);
    }
  });
  std::vector<Item> items;
  for (int64_t i = 0; i < n; ++i) {
    const Chunk& c = chunks[i];
    for (int64_t tile = 0; tile * kQueries < c.query_len; ++tile) {
      const int64_t seen = c.context_len - c.query_len +
                           std::min(c.query_len, (tile + 1) * kQueries);
      for (int64_t h = 0; h < l.heads; ++h) items.push_back({i, h, tile, l.steps(seen)});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.steps > b.steps; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size())));
  auto* op = out.data_ptr<c10::BFloat16>();
  // Each thread takes the next item until none is left.
  const auto run = [&](auto& products) {
    Scratch scratch(l.dim);
    for (int64_t j; (j = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      const Item& it = items[j];
      const Chunk& c = chunks[it.chunk];
      const int64_t kv = it.head / (l.heads / l.kv_heads);
      attend_item(l, c, it, qp, k_cache,
                  pairs.get() + c.values + kv * l.values_per_head(c.context_len) / 2,
                  static_cast<float>(scale), op, scratch, products);
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#ifdef PREFILL_TILES
    if (tiles && amx_usable()) {
      TileProducts products{l.dim};
      configure_tiles();
      run(products);
      _tile_release();
      return;
    }
#endif
    VectorProducts products{l.dim};
    run(products);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("paged_prefill(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_lens, "
        "Tensor context_lens, float scale, bool tiles) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
