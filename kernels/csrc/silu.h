// silu(gate) * up, the one formula elementwise.cpp's silu_mul and panels.h's gated epilogue
// both use, so that the fused op gives the separate ops' bits by construction: in ATen's vector
// type (its vectorized exp) for whole vectors of a row, one float at a time past them.

#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cmath>

namespace shoal_silu {

using Vec = at::vec::Vectorized<float>;

inline Vec silu_mul(const Vec& gate, const Vec& up) {
  return (gate / (Vec(1.f) + gate.neg().exp())) * up;
}

inline float silu_mul(float gate, float up) { return (gate / (1.f + std::exp(-gate))) * up; }

}  // namespace shoal_silu
