// Attention-logit soft-capping (Gemma 2's attn_logit_softcapping): a score s becomes
// cap * tanh(s / cap) before the mask and the softmax. Shared by the decode kernels
// (paged_decode.cpp, paged_decode_amx.h) and the prefill kernels (paged_prefill*.h).
#pragma once

#include "vec.h"

namespace {

// tanh(x) per lane, from e^(-2|x|) so the exponential never overflows (vec.h's
// exp_nonpositive): (1 - e) / (1 + e), with x's sign. Near 0 the difference loses bits
// relative to x, but not against the cap it is scaled by (~1e-7 * cap absolute, far below
// what moves a softmax weight). V: vec.h's vf or native_vec.h's vn.
template <typename V>
inline V tanh_lanes(V x) {
  const V a = x < 0 ? -x : x;
  const V e = exp_nonpositive(-2.f * a);
  const V t = (1.f - e) / (1.f + e);
  return x < 0 ? -t : t;
}

// The cap of one call (0: none). Applied where a path forms its scores; when off it costs
// one predictable branch per batch of scores, so the uncapped paths keep their speed.
struct SoftCap {
  float cap = 0.f, inv = 0.f;
  SoftCap() = default;
  explicit SoftCap(float c) : cap(c), inv(c > 0.f ? 1.f / c : 0.f) {}
  bool on() const { return cap > 0.f; }
  // The same cap for scores held divided by `scale` (a path that scales them later):
  // (cap / scale) * tanh(x / (cap / scale)) = cap * tanh(x * scale / cap) / scale.
  SoftCap unscaled(float scale) const { return on() ? SoftCap(cap / scale) : SoftCap(); }
  template <typename V>
  V operator()(V s) const {
    return on() ? cap * tanh_lanes(s * inv) : s;
  }
};

}  // namespace
