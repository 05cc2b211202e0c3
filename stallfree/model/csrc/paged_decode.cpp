// Decode attention that reads the paged KV cache in place (CPU).
//
// One query token per request against its context, read 32 tokens at a time (16 in the AMX
// tiles of paged_decode_amx.h) straight from the cache [2, num_blocks, block_size, Hkv, D]
// through the request's block table: no gather into a dense buffer, no padding to the
// longest context. Online softmax in fp32; bfloat16 and float16 rows are widened to fp32 in
// registers where they are used, the query heads of a GQA group reading the same rows from
// L1; on CPUs with AVX512_BF16, bf16 rows are multiplied as stored, in bf16-pair dot
// products (paged_decode_pairs.h); in builds without AVX-512, over 8-float halves of the
// vectors (paged_decode_halves.h). int8 rows (paged_int8.h) are widened once for up to 4
// query heads of a GQA group (3 in AVX2 builds), each row's scale applied to its score and
// its softmax weight (paged_decode_int8.h). The rows of tiles ahead are asked for while the
// current one computes, since blocks lie anywhere in the cache.
//
// Threads: a request's context may be cut into parts (flash-decoding), each part a work
// item with its own softmax state; each thread takes an equal share of the batch's tokens
// (deal_spans), so one long request among short ones does not leave a core idle, and the
// parts of a request are merged at the end. One parallel region per call, whatever the
// batch.
//
// A sliding window (Mistral, Gemma's local layers) starts a request's work at its window's
// first key, so a long context costs what its window does; soft-capped scores (Gemma 2) are
// capped as they leave the product (paged_decode_softcap.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_decode.h"
#include "paged_decode_deal.h"
#include "paged_decode_amx.h"
#include "paged_decode_int8.h"
#include "paged_decode_pairs.h"
#include "paged_decode_query.h"
#include "paged_decode_softmax.h"
#include "vec.h"

namespace {

// Up to kTile consecutive tokens (`n` of them, their cache rows at `rows`, the tail repeating
// the first) for every query head: scores, online softmax, then the weighted V rows.
// C: head_dim / 16, a compile-time count so a head's query and output stay in registers.
// Rows are widened where they are used, once per query head: from L1 after the first, a
// shift and a mask per vector cost less than a round trip through a buffer (with
// AVX512_BF16, bf16 rows are multiplied as stored, and a GQA group's heads weigh each pair
// of V rows together). A tile ahead's rows (`next`) are asked for one KV head at a time and
// a token at a time: its K rows as the scores reach the same token of this tile, its V rows
// as the weighted values do. Asked all at once, a head's 128 lines queued up and the tile's
// own loads waited behind them (1.1-1.3x per layer at 8-64 decodes with the cache in DRAM,
// 2-core EPYC, docs/benchmarks.md).
template <typename T, int C>
void attend_tile(const Shape& s, const vf* q, const T* k, const T* v, const int64_t* rows,
                 int n, const Partial& out, const int64_t* next, int n_next) {
  const int64_t group = s.heads / s.kv_heads;
  // Heads per pass: HG * C accumulators for the weighted values of the pairs path.
  constexpr int HG = kSplit<T, C> ? (C >= 12 ? 1 : 12 / C) : 1;
  for (int64_t kv = 0; kv < s.kv_heads; ++kv) {
    const int64_t head = kv * C * kLanes;
    for (int64_t h0 = kv * group; h0 < (kv + 1) * group; h0 += HG) {
      const int count = static_cast<int>(std::min<int64_t>(HG, (kv + 1) * group - h0));
      const TileAhead<T, C * kLanes> ahead{k + head, v + head, next,
                                           h0 == kv * group ? n_next : 0};  // first pass asks
      vf p[HG][2];
      float alpha[HG];
      softmax_steps<T, C, HG>(q, k + head, rows, n, out, h0, count, p, alpha, ahead, s.cap);
#ifdef __AVX512BF16__
      if constexpr (kSplit<T, C>) {
        weighted_values_pairs<C, HG>(v + head, rows, n, p, alpha, h0, count, out.acc, ahead);
        continue;
      }
#endif
      for (int hl = 0; hl < count; ++hl) {  // every head of the pass (a bf16 cache built
        float* acc_out = out.acc + (h0 + hl) * C * kLanes;  // without AVX512_BF16 has 3)
#ifdef __AVX512F__
        vf acc[C];
        std::memcpy(acc, acc_out, sizeof acc);
        for (int c = 0; c < C; ++c) acc[c] *= alpha[hl];
        for (int j = 0; j < n; ++j) {
          if (hl == 0) ahead.ask_v(j);
          vf vr[C];
          load_row<T, C>(v + rows[j] + head, vr);
          for (int c = 0; c < C; ++c) acc[c] += p[hl][j / kLanes][j % kLanes] * vr[c];
        }
        std::memcpy(acc_out, acc, sizeof acc);
#else
        weighted_values_halves<T, C>(v + head, rows, n, p[hl], alpha[hl], acc_out,
                                     hl == 0 ? &ahead : nullptr);
#endif
      }
    }
  }
}

// Tiles whose rows are asked for ahead of the one being computed. Once the asking was
// spread over the tile (attend_tile), one ahead measured as well as two, or better, at 1-64
// decodes (2-core EPYC, docs/benchmarks.md); two had been 1.09-1.22x faster at 8-64 while
// a head's rows were asked all at once.
constexpr int kAhead = 1;

template <typename T, int C>
void attend(const Shape& s, const vf* q, const T* k_cache, const T* v_cache,
            const int64_t* table, const Item& item, const Partial& out) {
  const int64_t H = s.heads, bs = s.block_size;
  const int64_t row_len = s.kv_heads * row_elems<T>(C * kLanes);
  std::fill(out.max, out.max + H, -std::numeric_limits<float>::infinity());
  std::fill(out.sum, out.sum + H, 0.f);
  std::fill(out.acc, out.acc + H * C * kLanes, 0.f);
  // Cache offsets of one tile's tokens; the tail repeats the first token (masked out).
  auto offsets = [&](int64_t start, int64_t* rows) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, item.end - start));
    for (int j = 0; j < n; ++j) {
      const int64_t t = start + j, block = table[t / bs];
      TORCH_CHECK(block >= 0 && block < s.num_blocks, "block id ", block, " outside the cache");
      rows[j] = (block * bs + t % bs) * row_len;
    }
    for (int j = n; j < kTile; ++j) rows[j] = rows[0];
    return n;
  };
  // Rows of the tiles in flight: this one and the kAhead after it, in a ring.
  int64_t rows[kAhead + 1][kTile];
  int count[kAhead + 1] = {};
  for (int a = 0; a < kAhead; ++a) {  // the first tiles' rows; attend_tile asks for the rest
    const int64_t start = item.begin + a * kTile;
    if (start >= item.end) break;
    count[a] = offsets(start, rows[a]);
    prefetch_rows(k_cache, v_cache, rows[a], count[a], 0, row_len * int64_t(sizeof(T)));
  }
  for (int64_t start = item.begin, i = 0; start < item.end; start += kTile) {
    const int64_t ahead = start + kAhead * kTile;
    const int64_t slot = (i + kAhead) % (kAhead + 1);
    count[slot] = ahead < item.end ? offsets(ahead, rows[slot]) : 0;
    if constexpr (std::is_same_v<T, int8_t>)  // paged_decode_int8.h
      attend_tile_int8<C>(s, q, k_cache, v_cache, rows[i], count[i], out, rows[slot],
                          count[slot]);
    else
      attend_tile<T, C>(s, q, k_cache, v_cache, rows[i], count[i], out, rows[slot], count[slot]);
    i = (i + 1) % (kAhead + 1);
  }
}

// The query as the tile path takes it: bf16, unscaled ([B, Hq, D] contiguous), or null
// for the vector path.
struct TileQuery {
  const c10::BFloat16* q = nullptr;
  float scale = 1.f;
};

template <typename T, int C>
void run(const Shape& s, const VectorQuery& q, const T* cache, const int64_t* tables,
         const int64_t* lens, const int64_t* lo, int64_t rows, at::Tensor& out, int64_t split,
         TileQuery tq) {
  const int64_t H = s.heads, D = s.dim;
  const T* k_cache = cache;
  const T* v_cache = cache + s.num_blocks * s.block_size * s.kv_heads * row_elems<T>(D);
  const Deal deal = split < 0 ? deal_spans(lens, lo, rows)
                              : deal_fixed(lens, lo, rows, split, s.block_size);
  const std::vector<Item>& items = deal.items;
  const std::vector<int64_t>& first = deal.first;
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t threads = static_cast<int64_t>(first.size()) - 1;
  std::vector<float> state(n * H * (D + 2));
  auto partial = [&](int64_t i) {
    float* p = state.data() + i * H * (D + 2);
    return Partial{p, p + H, p + 2 * H};
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
#ifdef STALLFREE_AMX
    if constexpr (std::is_same_v<T, c10::BFloat16> && C % 2 == 0) {
      if (tq.q != nullptr) {
        const ColumnTiles ct = column_tiles(s);
        std::vector<uint16_t> qpack(ct.packed_elems(s.kv_heads));
        configure_tiles();
        for (int64_t th = t0; th < t1; ++th)
          for (int64_t i = first[th]; i < first[th + 1]; ++i) {
            const Item& it = items[i];
            pack_query(s, ct, tq.q + it.row * H * D, D, qpack.data());
            attend_amx<C>(s, ct, qpack.data(), tq.scale, k_cache, v_cache,
                          tables + it.row * s.max_blocks, it, partial(i));
          }
        _tile_release();
        return;
      }
    }
#endif
    std::vector<vf> qv(H * C);
    for (int64_t th = t0; th < t1; ++th) {
      for (int64_t i = first[th]; i < first[th + 1]; ++i) {
        const Item& it = items[i];
        hold_query<T, C>(q, it.row, H, qv.data());
        attend<T, C>(s, qv.data(), k_cache, v_cache, tables + it.row * s.max_blocks, it,
                     partial(i));
      }
    }
  });
  // Merge each request's parts: rescale every part to the largest max, then normalise.
  std::vector<int64_t> row_first(rows + 1, 0);  // items are in row order
  for (const Item& it : items) ++row_first[it.row + 1];
  for (int64_t r = 0; r < rows; ++r) row_first[r + 1] += row_first[r];
  // On the calling thread: a few floats per query head and part (~2% of the attention's
  // reads), where a second parallel region would add a barrier.
  std::vector<float> held(D), o(H * D);  // one head's output in held order; one row's
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t a = row_first[r], b = row_first[r + 1];
    if (a == b) {  // no context: nothing to attend to
      std::fill(o.begin(), o.end(), 0.f);
      store_row(o.data(), out, r);
      continue;
    }
    for (int64_t h = 0; h < H; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t i = a; i < b; ++i) m = std::max(m, partial(i).max[h]);
      float total = 0.f;
      std::fill(held.begin(), held.end(), 0.f);
      for (int64_t i = a; i < b; ++i) {
        const Partial p = partial(i);
        const float w = std::exp(p.max[h] - m);
        total += w * p.sum[h];
        const float* acc = p.acc + h * D;
        for (int64_t d = 0; d < D; ++d) held[d] += w * acc[d];
      }
      const float inv = 1.f / total;
      float* oh = o.data() + h * D;
      for (int c = 0; c < C; ++c)
        for (int l = 0; l < kLanes; ++l) oh[dim_of<T, C>(c, l)] = held[c * kLanes + l] * inv;
    }
    store_row(o.data(), out, r);
  }
}

// q [B, Hq, D] (last dim contiguous), kv_cache [2, num_blocks, block_size, Hkv, D]
// contiguous (float32, bf16, fp16; or int8 [..., Hkv, D + 4], rows of D values and their
// float32 scale, paged_int8.h), block_tables [B, max_blocks] int64, context_lens [B] int64
// (keys each query sees, its own included). Returns [B, Hq, D] in q's dtype. `split`:
// tokens per work item (deal_fixed; 0: whole requests), or -1 (the engine's): a span per
// thread (deal_spans).
// `tiles`: scores in AMX tiles where the CPU and the shapes allow it (paged_decode_amx.h),
// else the vector path. `window` > 0: each query sees only its last `window` keys (a
// sliding window: the work starts there, so a long context costs no more than the window);
// `softcap` > 0: scores become softcap * tanh(score / softcap). 0: off.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t split, bool tiles, int64_t window,
                        double softcap) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "paged_decode runs on CPU");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "need q [B, Hq, D] and kv_cache [2, blocks, block_size, Hkv, D]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode: window and softcap must be >= 0");
  const Shape s{q.size(1), kv_cache.size(3), q.size(2), kv_cache.size(2), kv_cache.size(1),
                block_tables.size(-1), SoftCap(static_cast<float>(softcap))};
  const bool int8 = kv_cache.scalar_type() == at::kChar;  // rows of D values and a scale
  TORCH_CHECK(kv_cache.size(4) == (int8 ? row_elems<int8_t>(s.dim) : s.dim) &&
                  s.heads % s.kv_heads == 0,
              "q and kv_cache disagree on head_dim or the GQA group");
  const int64_t rows = q.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows &&
                  block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(),
              "block_tables must be a contiguous int64 [B, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1 && context_lens.size(0) == rows &&
                  context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(),
              "context_lens must be a contiguous int64 [B]");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= s.max_blocks * s.block_size, "context ", lens[r],
                " of row ", r, " does not fit its block table");
  std::vector<int64_t> lo(rows, 0);  // each row's first key
  if (window > 0)
    for (int64_t r = 0; r < rows; ++r) lo[r] = std::max<int64_t>(0, lens[r] - window);
  const at::ScalarType q_type = q.scalar_type();
  TORCH_CHECK(q_type == at::kFloat || q_type == at::kBFloat16 || q_type == at::kHalf,
              "paged_decode: unsupported query dtype ", q_type);
  at::Tensor out = at::empty({rows, s.heads, s.dim}, q.options());
  if (rows == 0) return out;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  // The query as the path taking it wants it: a bf16 contiguous copy, unscaled, for the
  // tiles; q as it is for the vectors (rows and heads at any stride, dims contiguous).
  TileQuery tq;
  at::Tensor qb, qd = q.stride(2) == 1 ? q : q.contiguous();
  if (tiles && kv_cache.scalar_type() == at::kBFloat16 && amx_attention_fits(s)) {
    qb = q.to(at::kBFloat16).contiguous();
    tq = {qb.data_ptr<c10::BFloat16>(), static_cast<float>(scale)};
  }
  const VectorQuery vq{qd.data_ptr(), q_type, qd.stride(0), qd.stride(1),
                       static_cast<float>(scale)};
  auto dispatch = [&](auto* cache) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cache)>>;
    switch (s.dim) {
      case 16: return run<T, 1>(s, vq, cache, tables, lens, lo.data(), rows, out, split, tq);
      case 32: return run<T, 2>(s, vq, cache, tables, lens, lo.data(), rows, out, split, tq);
      case 64: return run<T, 4>(s, vq, cache, tables, lens, lo.data(), rows, out, split, tq);
      case 128: return run<T, 8>(s, vq, cache, tables, lens, lo.data(), rows, out, split, tq);
      default: TORCH_CHECK(false, "paged_decode: unsupported head_dim ", s.dim);
    }
  };
  switch (kv_cache.scalar_type()) {
    case at::kFloat: dispatch(kv_cache.data_ptr<float>()); break;
    case at::kBFloat16: dispatch(kv_cache.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: dispatch(kv_cache.data_ptr<c10::Half>()); break;
    case at::kChar: dispatch(kv_cache.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported KV dtype ", kv_cache.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(stallfree, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int split, bool tiles, int window=0, float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("paged_decode", &paged_decode); }
