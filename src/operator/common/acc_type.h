/*
 * acc_type.h: storage and accumulation types shared by the CPU and CUDA kernels.
 *
 * Storage types: float, double, and fp16. On the host fp16 is `Half` (raw IEEE binary16 bits);
 * in CUDA code it is `__half`. Every kernel widens to AccT<T> in registers and narrows on store:
 *   AccT<Half> = AccT<__half> = float,  AccT<float> = float,  AccT<double> = double.
 * fp16 tensors are therefore read once as fp16 and never copied to an fp32 tensor.
 */
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define GN_HOST_DEVICE __host__ __device__
#define GN_INLINE __host__ __device__ __forceinline__
#else
#define GN_HOST_DEVICE
#define GN_INLINE inline __attribute__((always_inline))
#endif

#if !defined(__CUDA_ARCH__) && (defined(__F16C__))
#include <immintrin.h>
#define GN_HAVE_F16C 1
#endif

namespace gn_mx {

// Values equal mxnet::ext::MXDType (and mshadow's type flags), so the adapter casts directly.
enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2 };

// Host-side IEEE binary16 storage. Same size and alignment as __half.
struct Half {
  uint16_t bits;
};

// binary16 -> binary32, exact (every half is representable as a float).
GN_INLINE float half_bits_to_float(uint16_t h) {
#if defined(GN_HAVE_F16C)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {                    // inf / nan
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {                 // normal
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {                 // +-0
    bits = sign;
  } else {                               // subnormal: renormalize
    int e = -1;
    do { ++e; man <<= 1; } while ((man & 0x400u) == 0);
    bits = sign | ((112u - e) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

// binary32 -> binary16 with round-to-nearest-even, overflow to inf, nan preserved.
GN_INLINE uint16_t float_to_half_bits(float f) {
#if defined(GN_HAVE_F16C)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  memcpy(&x, &f, sizeof(x));
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax >= 0x7F800000u) {               // inf / nan
    return sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u : 0u);
  }
  if (ax >= 0x477FF000u) return sign | 0x7C00u;   // rounds to >= 65520: overflow
  if (ax < 0x38800000u) {                // result is subnormal or zero
    if (ax < 0x33000000u) return sign;   // < 2^-25 rounds to zero
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;     // 14 + (113 - e) - 1
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return sign | static_cast<uint16_t>(r);
  }
  uint32_t r = ((ax >> 13) - (112u << 10));
  const uint32_t rem = ax & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return sign | static_cast<uint16_t>(r);
#endif
}

template <typename T> struct AccType { using type = T; };
template <> struct AccType<Half> { using type = float; };
#if defined(__CUDACC__)
template <> struct AccType<__half> { using type = float; };
#endif
template <typename T> using AccT = typename AccType<T>::type;

// Widen a stored value to its accumulation type / narrow an accumulator back to storage.
template <typename T> struct Cast {
  static GN_INLINE AccT<T> load(T v) { return static_cast<AccT<T>>(v); }
  template <typename A> static GN_INLINE T store(A a) { return static_cast<T>(a); }
};
template <> struct Cast<Half> {
  static GN_INLINE float load(Half v) { return half_bits_to_float(v.bits); }
  template <typename A> static GN_INLINE Half store(A a) {
    return Half{float_to_half_bits(static_cast<float>(a))};
  }
};
#if defined(__CUDACC__)
template <> struct Cast<__half> {
  static GN_INLINE float load(__half v) { return __half2float(v); }
  template <typename A> static GN_INLINE __half store(A a) {
    return __float2half_rn(static_cast<float>(a));
  }
};
#endif

template <typename T> GN_INLINE AccT<T> to_acc(T v) { return Cast<T>::load(v); }
template <typename T, typename A> GN_INLINE T from_acc(A a) { return Cast<T>::template store<A>(a); }

// Accumulation dtype for a data dtype (the dtype of mean/var/rstd outputs).
inline DType acc_dtype(DType t) { return t == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32; }

inline size_t dtype_size(DType t) {
  return t == DType::kFloat64 ? 8 : (t == DType::kFloat32 ? 4 : 2);
}

}  // namespace gn_mx
