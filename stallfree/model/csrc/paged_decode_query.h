// The decode-attention kernel's (paged_decode.cpp) query and output as its vector path
// takes them: q read in place, the output written in q's dtype.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "paged_decode.h"
#include "vec.h"

namespace {

// The query as the vector path reads it: q itself, in its dtype and strides (often a view
// of the fused qkv), scaled and widened as each work item takes its row into registers, so
// no converted copy of q is made per call.
struct VectorQuery {
  const void* data;
  at::ScalarType type;
  int64_t row, head;  // strides, in elements
  float scale;
};

template <typename T, int C, typename Q>
void hold_query_as(const Q* q, int64_t head_stride, int64_t H, float scale, vf* qv) {
  for (int64_t h = 0; h < H; ++h)
    for (int c = 0; c < C; ++c)
      for (int l = 0; l < kLanes; ++l)
        qv[h * C + c][l] = static_cast<float>(q[h * head_stride + dim_of<T, C>(c, l)]) * scale;
}

template <typename T, int C>
void hold_query(const VectorQuery& q, int64_t row, int64_t H, vf* qv) {
  const int64_t at = row * q.row;
  switch (q.type) {
    case at::kBFloat16:
      return hold_query_as<T, C>(static_cast<const c10::BFloat16*>(q.data) + at, q.head, H,
                                 q.scale, qv);
    case at::kHalf:
      return hold_query_as<T, C>(static_cast<const c10::Half*>(q.data) + at, q.head, H,
                                 q.scale, qv);
    default:
      return hold_query_as<T, C>(static_cast<const float*>(q.data) + at, q.head, H, q.scale,
                                 qv);
  }
}

// Row r of the output [B, H, D] in its dtype, from fp32 (rounded as torch's .to() rounds).
void store_row(const float* src, at::Tensor& out, int64_t r) {
  const int64_t n = out.size(1) * out.size(2);
  switch (out.scalar_type()) {
    case at::kBFloat16: {
      c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = c10::BFloat16(src[i]);
      return;
    }
    case at::kHalf: {
      c10::Half* o = out.data_ptr<c10::Half>() + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = c10::Half(src[i]);
      return;
    }
    default:
      std::memcpy(out.data_ptr<float>() + r * n, src, n * sizeof(float));
  }
}

}  // namespace
