// The two hashes of robe_torchrec/hashing.py, bit-exact, and the per-feature values they
// read (Feature).

#pragma once

#include "common.h"

namespace robe {
namespace {

// ---------------------------------------------------------------------------------------
// hashing
// ---------------------------------------------------------------------------------------

inline uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= kFmixC1;
  x ^= x >> 33;
  x *= kFmixC2;
  x ^= x >> 33;
  return x;
}

struct Feature {
  int64_t out_offset, dim, w_offset, w_size, row_offset, num_rows;
  int64_t nblocks;  // ceil(dim / Z)
  uint64_t span;    // w_size - Z + 1: number of valid block starts
  uint64_t ref_d;   // min(span, P): h mod span == h mod ref_d for every h < P (< 2**32)
  uint64_t ref_magic;  // Lemire fastmod multiplier of ref_d
  bool mean;
  // the hash key of an id of this feature (wrapping, as torch's int64 arithmetic)
  uint64_t key(int64_t id) const { return static_cast<uint64_t>(id) + static_cast<uint64_t>(row_offset); }
};

// The weight of value p in its bag's sum: its per-sample weight (1 without), divided by the
// bag's length for MEAN pooling. (The forward computes it with its checks in between.)
template <typename acc_t>
inline acc_t value_scale(const acc_t* psw, int64_t p, const Feature& f, acc_t len) {
  const acc_t scale = psw != nullptr ? psw[p] : acc_t(1);
  return f.mean ? scale / len : scale;
}

// h_b = (key*A + b*B + C) mod P, start = h_b mod span. h_0 costs one constant-divisor mod,
// each next block one add and a conditional subtract; the mod span is Lemire's fastmod
// (exact: h < P < 2**31 and ref_d < 2**32).
struct RefHash {
  uint64_t a, c;  // raw int64 bit patterns (wrapping arithmetic, as torch does)
  uint64_t b_mod;  // B mod P (floor mod), so the incremental step is exact for any B
  // steps[b] = b * B mod P, for starts(): block b's h is h_0 + steps[b], less P if it
  // reaches P, without the step-by-step chain of blocks()
  static constexpr int64_t kMaxStartsBlocks = 64;
  std::array<uint64_t, kMaxStartsBlocks> steps;
  // h_0 = (key * A + C) mod P
  inline uint64_t first(uint64_t key) const {
    const int64_t x = static_cast<int64_t>(key * a + c);
    const int64_t r = x % static_cast<int64_t>(kPrime);
    return static_cast<uint64_t>(r < 0 ? r + static_cast<int64_t>(kPrime) : r);
  }
  static uint64_t start_in(uint64_t h, uint64_t magic, uint64_t d) {
    const uint64_t low = magic * h;
    return static_cast<uint64_t>((static_cast<unsigned __int128>(low) * d) >> 64);
  }
  template <typename Fn>
  inline void blocks(uint64_t key, const Feature& f, Fn&& fn) const {
    uint64_t h = first(key);
    const uint64_t magic = f.ref_magic, d = f.ref_d;
    for (int64_t blk = 0; blk < f.nblocks; ++blk) {
      fn(blk, start_in(h, magic, d));
      h += b_mod;
      h = h >= kPrime ? h - kPrime : h;
    }
  }
  // out[b] = w_offset + the start of block b (the forward's hash pass, for features of at
  // most kMaxStartsBlocks blocks), in a loop whose blocks do not wait on each other, so it
  // vectorizes. The high half of low * d is formed from low's 32-bit halves, which vector
  // units multiply: the same value as start_in's 128-bit product (exact: d < P < 2**32, so
  // neither sum overflows; a test checks the identity up to d = P - 1, beyond what the
  // tests' arrays reach), which stays in blocks() because one scalar 64x64 multiply beats
  // three there (measured: docs/benchmarks.md, "CPU kernel A/B history").
  inline void starts(uint64_t key, const Feature& f, int64_t w_offset, int64_t* __restrict__ out) const {
    const uint64_t h0 = first(key);
    const uint64_t magic = f.ref_magic, d = f.ref_d;
    const int64_t nblocks = f.nblocks;  // a local: the stores to out could alias f's fields
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      uint64_t h = h0 + steps[blk];
      h = h >= kPrime ? h - kPrime : h;
      const uint64_t low = magic * h;
      const uint64_t high = ((low >> 32) * d + (((low & 0xFFFFFFFFULL) * d) >> 32)) >> 32;
      out[blk] = w_offset + static_cast<int64_t>(high);
    }
  }
};

// base = fmix64(key + salt); h = fmix64(base + (b+1)*GOLDEN); start = ((h>>32)*span)>>32.
struct MixHash {
  uint64_t salt;
  static uint64_t start_in(uint64_t h, uint64_t span) { return ((h >> 32) * span) >> 32; }
  template <typename Fn>
  inline void blocks(uint64_t key, const Feature& f, Fn&& fn) const {
    uint64_t x = fmix64(key + salt);
    const uint64_t span = f.span;
    for (int64_t blk = 0; blk < f.nblocks; ++blk) {
      x += kGolden;
      fn(blk, start_in(fmix64(x), span));
    }
  }
  // out[b] = w_offset + the start of block b (the forward's hash pass). A value's blocks
  // hash independently of each other, so with nothing else in it this loop vectorizes.
  inline void starts(uint64_t key, const Feature& f, int64_t w_offset, int64_t* __restrict__ out) const {
    const uint64_t x = fmix64(key + salt);
    const uint64_t span = f.span;
    const int64_t nblocks = f.nblocks;  // a local: the stores to out could alias f's fields
    for (int64_t blk = 0; blk < nblocks; ++blk) {  // x + (blk + 1) * kGolden: blocks()'s x
      out[blk] = w_offset + static_cast<int64_t>(start_in(fmix64(x + static_cast<uint64_t>(blk + 1) * kGolden), span));
    }
  }
};

}  // namespace
}  // namespace robe
