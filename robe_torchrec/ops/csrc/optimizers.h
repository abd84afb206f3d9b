// The fused optimizers' update rules, stepping a range of the weights with its gradient
// (backward.cpp's backward_fused_ runs them, one cache-sized weight range at a time).

#pragma once

#include "common.h"

namespace robe {
namespace {

struct HParams {
  double lr, eps, beta1, beta2, wd;
};

// The steps read weights of type W (float16/bfloat16 storage, or T itself), compute in T
// (float32/float64, as the state) and write the weights back rounded to W.
template <typename W, typename T>
inline void sgd_range(W* __restrict__ w, const T* __restrict__ g, int64_t n, T lr, T wd) {
  const T neg_lr = -lr;
  if (wd != T(0)) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const T wi = static_cast<T>(w[i]);
      w[i] = static_cast<W>(wi + neg_lr * (g[i] + wd * wi));
    }
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) w[i] = static_cast<W>(static_cast<T>(w[i]) + neg_lr * g[i]);
  }
}

template <typename W, typename T>
inline void adagrad_range(W* __restrict__ w, T* __restrict__ s1, const T* __restrict__ g, int64_t n,
                          T lr, T eps, T wd) {
  const T neg_lr = -lr;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T wi = static_cast<T>(w[i]);
    const T gi = g[i] + wd * wi;
    const T s = s1[i] + gi * gi;
    s1[i] = s;
    w[i] = static_cast<W>(wi + neg_lr * (gi / (std::sqrt(s) + eps)));
  }
}

template <typename W, typename T>
inline void adam_range(W* __restrict__ w, T* __restrict__ m1, T* __restrict__ m2, const T* __restrict__ g,
                       int64_t n, T wd, T w1, T beta2, T one_minus_beta2, T inv_bias2_sqrt, T eps,
                       T neg_step) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const T wi = static_cast<T>(w[i]);
    const T gi = g[i] + wd * wi;
    const T m = m1[i] + w1 * (gi - m1[i]);  // torch.lerp(m1, g, w1) for w1 < 0.5
    const T v = m2[i] * beta2 + one_minus_beta2 * gi * gi;
    m1[i] = m;
    m2[i] = v;
    w[i] = static_cast<W>(wi + neg_step * (m / (std::sqrt(v) * inv_bias2_sqrt + eps)));
  }
}

// Row-wise Adagrad on rows [r0, r1) of Z elements (meta.py: row r is elements [r*Z, r*Z + Z)
// of the M weights, the last one shorter); g holds the gradient of element r0 * Z onwards.
// The squares are summed in element order, without simd, so a row's sum does not depend on
// the buffer's alignment or on which path or thread steps it.
template <typename W, typename T>
void rowwise_adagrad_rows(W* __restrict__ w, T* __restrict__ sum, const T* __restrict__ g, int64_t r0,
                          int64_t r1, int64_t Z, int64_t M, T lr, T eps, T wd) {
  const T neg_lr = -lr;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t lo = r * Z, n = std::min(Z, M - lo);
    W* __restrict__ wr = w + lo;
    const T* __restrict__ gr = g + (lo - r0 * Z);
    T sq = T(0);
    for (int64_t j = 0; j < n; ++j) {
      const T gj = gr[j] + wd * static_cast<T>(wr[j]);
      sq += gj * gj;
    }
    const T s = sum[r] + sq / static_cast<T>(n);
    sum[r] = s;
    const T denom = std::sqrt(s) + eps;
    for (int64_t j = 0; j < n; ++j) {
      const T wj = static_cast<T>(wr[j]);
      wr[j] = static_cast<W>(wj + neg_lr * ((gr[j] + wd * wj) / denom));
    }
  }
}

}  // namespace
}  // namespace robe
