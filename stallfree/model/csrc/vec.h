// 16-lane fp32 vectors for the CPU kernels: loads that widen bf16/fp16, stores that round
// to bf16 as torch does, and e^x. GCC/Clang vector extensions keep the kernels free of one
// instruction set's intrinsics: one AVX-512 register, two AVX2 ones.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

typedef float vf __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef uint32_t vu __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// 16 values widened to fp32 from an unaligned address.
inline vf load16(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load16(const c10::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vf>(__builtin_convertvector(h, vu) << 16);
}

inline vf load16(const c10::Half* p) {
#ifdef __FLT16_MANT_DIG__
  typedef _Float16 vhf __attribute__((vector_size(32)));
  vhf h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, vf);
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
#endif
}

inline float hsum(vf a) {
  vf8 s8 = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// 16 fp32 values stored at an unaligned address, rounded to bf16 as c10::BFloat16 rounds:
// to nearest even, any NaN to the canonical quiet NaN.
inline void store16(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

inline vf round_bf16(vf v) {  // v rounded to bf16's precision, still as fp32
  const vu u = reinterpret_cast<vu>(v);
  const vu rounded = (u + (0x7fffu + ((u >> 16) & 1u))) & 0xffff0000u;
  const vu nan = reinterpret_cast<vu>((u & 0x7fffffffu) > 0x7f800000u);  // ones where NaN
  return reinterpret_cast<vf>((nan & 0x7fc00000u) | (~nan & rounded));
}

inline void store16(c10::BFloat16* p, vf v) {
  const vh h = __builtin_convertvector(reinterpret_cast<vu>(round_bf16(v)) >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}

typedef int32_t vi __attribute__((vector_size(64)));

// e^x for x <= 0 in every lane (Cephes' expf polynomial, ~1 ulp).
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.0f, magic = vf{} + 12582912.0f;  // 1.5 * 2^23 rounds to integers
  x = x < lo ? lo : x;
  const vf n = (x * 1.44269504088896341f + magic) - magic;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = vf{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * reinterpret_cast<vf>((__builtin_convertvector(n, vi) + 127) << 23);
}

// The first n (< 16) values of p, zero-padded; and their store. Row tails of any width.
template <typename T>
inline vf load_n(const T* p, int n) {
  T tmp[kLanes] = {};
  std::memcpy(tmp, p, n * sizeof(T));
  return load16(tmp);
}

template <typename T>
inline void store_n(T* p, vf v, int n) {
  T tmp[kLanes];
  store16(tmp, v);
  std::memcpy(p, tmp, n * sizeof(T));
}

// Loads and stores of n <= 16 values.
template <typename T>
inline vf load_any(const T* p, int n) {
  return n == kLanes ? load16(p) : load_n(p, n);
}

template <typename T>
inline void store_any(T* p, vf v, int n) {
  if (n == kLanes)
    store16(p, v);
  else
    store_n(p, v, n);
}

// fp32 values rounded as a tensor of T would hold them.
template <typename T>
inline vf in_dtype(vf v) {
  if constexpr (std::is_same_v<T, float>)
    return v;
  else
    return round_bf16(v);
}

// fn(static_cast<T*>(nullptr)) for x's dtype T, float32 or bfloat16; `op` names the caller
// in the error.
template <typename F>
void dispatch_float_bf16(const at::Tensor& x, const char* op, F&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat: fn(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: fn(static_cast<c10::BFloat16*>(nullptr)); break;
    default: TORCH_CHECK(false, op, ": float32 or bfloat16 expected, got ", x.scalar_type());
  }
}

}  // namespace
