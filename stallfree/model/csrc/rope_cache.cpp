// RoPE on q and k, in place in the fused qkv matmul's output, and the new tokens' k and v
// written to their cache slots, in one pass (CPU).
//
// In torch this is a flip, two products and a sum over q and k together, then one
// index_copy_ each for k and v: six ops with four temporaries per layer, whose dispatch is
// most of their cost at a decode step's few rows. Rounds where the torch reference path
// does (layers.apply_rope, attention.paged_attention): each product and the sum to the
// dtype, so results equal it (a sum of two rounded products rounds once in fp32 first
// only where their exponents are 24 or more apart).
//
// Into an int8 cache (model/kv_quant.py) each k and v head is written as a quantized row:
// head_dim int8 values q, then the row's float32 scale s, with s = max|x| / 127 and q =
// round-half-to-even(x / s) (0 where s is 0), x being the head as rounded to the dtype:
// kv_quant.quantize's arithmetic, so both writes give the same bytes.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vec.h"

namespace {

// Tokens per parallel task: a decode step's few rows run on the calling thread.
constexpr int64_t kTokenGrain = 8;

// One head of `dim` values rotated in place: first half pairs with the second, `sin`
// holds rotate_half's sign (see RotaryEmbedding._table).
template <typename T>
inline void rotate(T* x, const T* cos, const T* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; i += kLanes) {
    const vf a = load16(x + i), b = load16(x + half + i);
    const vf ra = in_dtype<T>(in_dtype<T>(a * load16(cos + i)) +
                              in_dtype<T>(b * load16(sin + i)));
    const vf rb = in_dtype<T>(in_dtype<T>(b * load16(cos + half + i)) +
                              in_dtype<T>(a * load16(sin + half + i)));
    store16(x + i, ra);
    store16(x + half + i, rb);
  }
}

constexpr int64_t kScaleBytes = 4;  // kv_quant.SCALE_BYTES
constexpr float kQMax = 127.0f;       // kv_quant.Q_MAX

// A token's kv_heads heads of `dim` values stored as the cache holds them: copied into a
// cache of their dtype, ...
template <typename T>
inline void store_heads(const T* x, T* out, int64_t kv_heads, int64_t dim) {
  std::memcpy(out, x, kv_heads * dim * sizeof(T));
}

// ... or quantized into an int8 cache's rows of dim + 4 bytes.
typedef int8_t vq __attribute__((vector_size(kLanes)));

template <typename T>
inline void store_heads(const T* x, int8_t* out, int64_t kv_heads, int64_t dim) {
  const vf zero{}, qmax = zero + kQMax, magic = zero + 12582912.0f;  // 1.5 * 2^23
  for (int64_t h = 0; h < kv_heads; ++h, x += dim, out += dim + kScaleBytes) {
    vf amax = zero;
    vi nan{};
    for (int64_t i = 0; i < dim; i += kLanes) {
      const vf v = load16(x + i);
      amax = (v < zero ? -v : v) > amax ? (v < zero ? -v : v) : amax;
      nan |= v != v;
    }
    bool any_nan = false;
    for (int j = 0; j < kLanes; ++j) any_nan |= nan[j] != 0;
    // A NaN makes the scale NaN, as torch's amax does; its row then holds q = 0.
    const float scale = any_nan ? std::numeric_limits<float>::quiet_NaN() : hmax(amax) / kQMax;
    const vf s = zero + scale;
    for (int64_t i = 0; i < dim; i += kLanes) {
      // Adding and taking away 1.5 * 2^23 rounds |r| < 2^22 to an integer, half to even
      // (torch.round's rule); no -ffast-math here to fold the pair away.
      vf r = (load16(x + i) / s + magic) - magic;
      r = r > qmax ? qmax : (r < -qmax ? -qmax : r);
      if (!(scale > 0.0f)) r = zero;  // an all-zero row: x / 0 would be NaN
      r = r == r ? r : zero;          // inf / inf: no integer either
      const vq q = __builtin_convertvector(__builtin_convertvector(r, vi), vq);
      std::memcpy(out + i, &q, sizeof q);
    }
    std::memcpy(out + dim, &scale, kScaleBytes);
  }
}

// C: the cache's element type, T (a float cache) or int8_t (rows of kv_quant.py).
template <typename T, typename C>
void rope_cache_rows(T* qkv, const T* cos, const T* sin, C* k_cache, C* v_cache,
                     const int64_t* slots, int64_t tokens, int64_t heads, int64_t kv_heads,
                     int64_t dim, int64_t num_slots) {
  for (int64_t t = 0; t < tokens; ++t)  // before any write: a bad slot changes nothing
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " outside the cache");
  const int64_t row = (heads + 2 * kv_heads) * dim;
  const int64_t kv_row = kv_heads * (std::is_same_v<C, T> ? dim : dim + kScaleBytes);
  at::parallel_for(0, tokens, kTokenGrain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      T* x = qkv + t * row;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate(x + h * dim, c, s, dim);
      const int64_t slot = slots[t];
      store_heads(x + heads * dim, k_cache + slot * kv_row, kv_heads, dim);
      store_heads(x + (heads + kv_heads) * dim, v_cache + slot * kv_row, kv_heads, dim);
    }
  });
}

// qkv [T, (Hq + 2 Hkv) D] contiguous (q | k | v heads), cos and sin [T, D] contiguous in
// qkv's dtype, kv_cache [2, blocks, block_size, Hkv, D] contiguous in qkv's dtype or
// [2, blocks, block_size, Hkv, D + 4] int8, slot_mapping [T] int64. D a multiple of 32.
void rope_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                at::Tensor& kv_cache, const at::Tensor& slot_mapping, int64_t heads,
                int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rope_cache: contiguous qkv [T, n] expected");
  const bool quantized = kv_cache.scalar_type() == at::kChar;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  (quantized || kv_cache.scalar_type() == qkv.scalar_type()) &&
                  kv_cache.size(3) == kv_heads,
              "rope_cache: kv_cache [2, blocks, block_size, Hkv, D] of qkv's dtype, or "
              "[2, blocks, block_size, Hkv, D + 4] int8, expected");
  const int64_t tokens = qkv.size(0), dim = kv_cache.size(4) - (quantized ? kScaleBytes : 0);
  TORCH_CHECK(dim % (2 * kLanes) == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "rope_cache: qkv width or head_dim (a multiple of 32) does not match");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == tokens && t->size(1) == dim &&
                    t->is_contiguous() && t->scalar_type() == qkv.scalar_type(),
                "rope_cache: cos and sin [T, D] of qkv's dtype expected");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "rope_cache: slot_mapping [T] int64 expected");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  const int64_t half = kv_cache.numel() / 2;  // K's part, then V's
  dispatch_float_bf16(qkv, "rope_cache", [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const auto run = [&](auto* cache) {
      rope_cache_rows(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), cache,
                      cache + half, slot_mapping.data_ptr<int64_t>(), tokens, heads, kv_heads,
                      dim, num_slots);
    };
    if (quantized)
      run(kv_cache.data_ptr<int8_t>());
    else
      run(kv_cache.data_ptr<T>());
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(stallfree, m) {
  m.def("rope_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int heads, int kv_heads) -> ()");
}

TORCH_LIBRARY_IMPL(stallfree, CPU, m) { m.impl("rope_cache", &rope_cache); }
