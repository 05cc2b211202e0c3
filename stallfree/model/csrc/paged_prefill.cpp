// Prefill attention over the paged KV cache (CPU; bfloat16, float32 or int8 cache): the op,
// its checks and its threads. The work items and their paths are in paged_prefill.h (bf16)
// and paged_prefill_f32.h (float32, and int8 rows dequantized a step at a time).
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
#include "paged_prefill_f32.h"
#include "paged_prefill_tiles.h"
#include "paged_prefill_vec.h"

namespace {

// Items of `queries` query positions of one head, each with its steps of `keys` keys (from
// the first key its first query sees to the last its last query sees), longest first so
// that the threads finish together.
std::vector<Item> make_items(const std::vector<Chunk>& chunks, const Layout& l, int64_t queries,
                             int64_t keys) {
  std::vector<Item> items;
  for (int64_t i = 0; i < static_cast<int64_t>(chunks.size()); ++i) {
    const Chunk& c = chunks[i];
    for (int64_t tile = 0; tile * queries < c.query_len; ++tile) {
      const int64_t pos0 = c.context_len - c.query_len + tile * queries;
      const int64_t seen =  // keys its last query sees
          c.context_len - c.query_len + std::min(c.query_len, (tile + 1) * queries);
      const int64_t first = l.first_key(pos0) / keys;
      for (int64_t h = 0; h < l.heads; ++h)
        items.push_back({i, h, tile, first, (seen + keys - 1) / keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.steps - a.first > b.steps - b.first;
  });
  return items;
}

// body(take) on each of up to `count` threads; take() gives the thread its next item's index,
// -1 once none is left.
template <typename Body>
void on_threads(int64_t count, Body&& body) {
  std::atomic<int64_t> next{0};
  const auto take = [&]() -> int64_t {
    const int64_t j = next.fetch_add(1);
    return j < count ? j : -1;
  };
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { body(take); });
}

// The float32 path (paged_prefill_f32.h), over a float32 cache or an int8 one (float32 q).
void prefill_f32(const at::Tensor& q, const at::Tensor& kv_cache, const Layout& l,
                 const std::vector<Chunk>& chunks, float scale, at::Tensor& out) {
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const std::vector<Item> items = make_items(chunks, l, kF32Queries, kF32Keys);
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  on_threads(static_cast<int64_t>(items.size()), [&](const auto& take) {
    const auto run = [&](auto& cache) {
      F32Scratch scratch(l.dim);
      for (int64_t j; (j = take()) >= 0;) {
        const Item& it = items[j];
        attend_item_f32(l, chunks[it.chunk], it, qp, cache, scale, op, scratch);
      }
    };
    if (int8) {
      const int8_t* k = kv_cache.data_ptr<int8_t>();
      Int8Rows cache(k, k + kv_cache.numel() / 2, l.row_len(), l.dim);
      run(cache);
    } else {
      const float* k = kv_cache.data_ptr<float>();
      F32Rows cache{k, k + kv_cache.numel() / 2, l.row_len()};
      run(cache);
    }
  });
}

// The bfloat16 path (paged_prefill.h): V^T copies in pairs, then the items in AMX tiles or
// AVX512_BF16 vectors.
void prefill_bf16(const at::Tensor& q, const at::Tensor& kv_cache, const Layout& l,
                  std::vector<Chunk>& chunks, float scale, bool tiles, at::Tensor& out) {
#ifndef PREFILL_KERNEL
  TORCH_CHECK(false, "paged_prefill: a bfloat16 cache needs AVX512_BF16, which this build lacks");
#else
  int64_t values = 0;
  for (Chunk& c : chunks) {
    c.values = values;
    c.first_step = l.first_key(c.context_len - c.query_len) / kKeys;
    values += l.kv_heads * l.values_per_head(c) / 2;
  }
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  const auto* k_cache = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<c10::BFloat16>());
  const uint16_t* v_cache = k_cache + kv_cache.numel() / 2;
  // The values in pairs, per chunk, KV head and step of 32 keys (from the first step a query
  // of the chunk sees); every word is written below, so the buffer is not zeroed first.
  std::unique_ptr<uint32_t[]> pairs(new uint32_t[values]);
  std::vector<std::array<int64_t, 3>> copies;  // chunk, KV head, step
  for (int64_t i = 0; i < static_cast<int64_t>(chunks.size()); ++i)
    for (int64_t kv = 0; kv < l.kv_heads; ++kv)
      for (int64_t st = chunks[i].first_step; st < l.steps(chunks[i].context_len); ++st)
        copies.push_back({i, kv, st});
  const int64_t words_per_step = l.dim * kKeys / 2;
  at::parallel_for(0, static_cast<int64_t>(copies.size()), 8, [&](int64_t a, int64_t b) {
    for (int64_t j = a; j < b; ++j) {
      const auto [i, kv, st] = copies[j];
      const Chunk& c = chunks[i];
      const int64_t steps = l.steps(c.context_len) - c.first_step;
      uint32_t* dst = pairs.get() + c.values + (kv * steps + st - c.first_step) * words_per_step;
      copy_values(l, c, v_cache, kv, st, dst);
    }
  });
  const std::vector<Item> items = make_items(chunks, l, kQueries, kKeys);
  auto* op = out.data_ptr<c10::BFloat16>();
  on_threads(static_cast<int64_t>(items.size()), [&](const auto& take) {
    const auto run = [&](auto& products) {
      Scratch scratch(l.dim);
      for (int64_t j; (j = take()) >= 0;) {
        const Item& it = items[j];
        const Chunk& c = chunks[it.chunk];
        const int64_t kv = it.head / (l.heads / l.kv_heads);
        attend_item(l, c, it, qp, k_cache,
                    pairs.get() + c.values + kv * l.values_per_head(c) / 2, scale,
                    op, scratch, products);
      }
    };
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
}

// q [T, Hq, D] (last dim contiguous; rows may be strided), kv_cache [2, num_blocks,
// block_size, Hkv, D] contiguous, both bfloat16 or both float32 (or an int8 cache [..., Hkv,
// D + 4] of rows and their scales, paged_int8.h, under a float32 or bfloat16 q: the float32
// path, a bf16 q widened first and the output rounded back), with every chunk's own keys
// and values written. Chunk i owns the next query_lens[i] rows of q and sees context_lens[i]
// keys through block_tables[i]. Returns [T, Hq, D] in q's dtype. `tiles`: a bf16 cache's
// products in AMX tiles where the CPU allows, else in AVX512_BF16 vectors. `window` > 0: a
// query at position p sees only keys (p - window, p]; `softcap` > 0: scores become
// softcap * tanh(score / softcap). 0: off.
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& kv_cache,
                         const at::Tensor& block_tables, const at::Tensor& query_lens,
                         const at::Tensor& context_lens, double scale, bool tiles,
                         int64_t window, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_prefill runs on CPU");
  const bool f32 = q.scalar_type() == at::kFloat;
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && (f32 || q.scalar_type() == at::kBFloat16),
              "paged_prefill: q must be bf16 or float32 [T, Hq, D] with contiguous rows of a "
              "head");
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (int8 || kv_cache.scalar_type() == q.scalar_type()),
              "paged_prefill: kv_cache must be a contiguous [2, blocks, bs, Hkv, D] of q's dtype "
              "or int8");
  if (int8 && !f32) {  // a bf16 q over an int8 cache: the float32 path, in float32
    const at::Tensor wide = paged_prefill(q.to(at::kFloat), kv_cache, block_tables, query_lens,
                                          context_lens, scale, tiles, window, softcap);
    return wide.to(q.scalar_type());
  }
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_prefill: window and softcap must be >= 0");
  const Layout l{q.size(1), kv_cache.size(3), q.size(2), kv_cache.size(2), kv_cache.size(1),
                 q.stride(0), q.stride(1), window, SoftCap(static_cast<float>(softcap)),
                 int8 ? kRowExtra<int8_t> : 0};
  TORCH_CHECK(kv_cache.size(4) == l.dim + l.extra && l.heads % l.kv_heads == 0,
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
  int64_t rows = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t ql = query_lens.data_ptr<int64_t>()[i];
    const int64_t ctx = context_lens.data_ptr<int64_t>()[i];
    TORCH_CHECK(ql >= 1 && ql <= ctx && ctx <= block_tables.size(1) * l.block_size,
                "paged_prefill: chunk ", i, " has query_len ", ql, " and context ", ctx,
                " (need 1 <= query_len <= context <= its block table's capacity)");
    chunks[i] = {rows, ql, ctx, block_tables.data_ptr<int64_t>() + i * block_tables.size(1), 0,
                 0};
    rows += ql;
  }
  TORCH_CHECK(rows == q.size(0), "paged_prefill: query_lens sum to ", rows, ", q has ",
              q.size(0), " rows");
  at::Tensor out = at::empty({rows, l.heads, l.dim}, q.options());
  if (f32)
    prefill_f32(q, kv_cache, l, chunks, static_cast<float>(scale), out);
  else
    prefill_bf16(q, kv_cache, l, chunks, static_cast<float>(scale), tiles, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("paged_prefill(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor query_lens, "
        "Tensor context_lens, float scale, bool tiles, int window=0, float softcap=0.0) -> "
        "Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
