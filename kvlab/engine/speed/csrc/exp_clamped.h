// exp_clamped: e^x for float32 without a library call, shared by kvlab's C++ speed paths
// (paged_kernel.cpp, fused_ops.cpp): an inline function, compiled into each.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvlab {
// e^x by Cephes' expf polynomial: no call and no branch, so a loop of it vectorises (GCC 12: under
// -fno-trapping-math). e^-87 (~1.6e-38) for x below -87, inf from about 88.4 up (the float e^x overflows
// from 88.72), NaN for NaN
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 89.0f);
  float n = std::floor(x * 1.44269504088896341f + 0.5f);
  // x - n * ln 2 in two parts (ln 2 = 0.693359375 - 2.12194440e-4)
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  // 2^n from its exponent bits (n is in [-126, 128] after the clamp, 2^128 the bits of inf; a NaN's n is
  // taken as 0, and y carries the NaN)
  int32_t bits = (static_cast<int32_t>(n == n ? n : 0.0f) + 127) << 23;
  float p;
  std::memcpy(&p, &bits, sizeof p);
  return y * p;
}
}  // namespace kvlab
