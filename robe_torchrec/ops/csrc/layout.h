// table_meta (robe_torchrec/ops/meta.py) parsed into a Layout, and the checks of
// robe_torchrec/ops/validation.py that the kernels run on their inputs.

#pragma once

#include "hash.h"

namespace robe {
namespace {

// ---------------------------------------------------------------------------------------
// table metadata
// ---------------------------------------------------------------------------------------

struct Layout {
  std::vector<Feature> feats;
  int64_t T = 0, B = 0, Z = 1;
  int64_t max_dim = 0, max_blocks = 0, sum_dim = 0;
};

// Parses table_meta and runs the meta-level checks of validation.check_inputs, in its order.
Layout parse_layout(const at::Tensor& table_meta, int64_t out_dim, int64_t Z, int64_t weights_numel,
                    int64_t hash_mode, int64_t offsets_numel) {
  if (table_meta.scalar_type() != at::kLong || table_meta.dim() != 2 ||
      table_meta.size(0) != NUM_META_FIELDS) {
    fail(cat("robe: table_meta must be int64 [", static_cast<int64_t>(NUM_META_FIELDS), ", T]"));
  }
  if (Z < 1) fail(cat("robe: block_size must be >= 1, got ", Z));
  if (hash_mode != HASH_REFERENCE && hash_mode != HASH_MIX) {
    fail(cat("robe: hash_mode must be 0 (reference) or 1 (mix), got ", hash_mode));
  }
  const at::Tensor meta = table_meta.to(at::kCPU).contiguous();
  const int64_t* m = meta.data_ptr<int64_t>();
  Layout L;
  L.T = meta.size(1);
  L.Z = Z;
  if (L.T == 0 || offsets_numel < 1 || (offsets_numel - 1) % L.T != 0) {
    fail(cat("robe: offsets has ", offsets_numel, " entries; expected T * B + 1 with T = ", L.T,
             " features"));
  }
  L.B = (offsets_numel - 1) / L.T;
  if (out_dim < 0) fail(cat("robe: output_dim must be >= 0, got ", out_dim));
  auto field = [&](int64_t f, int64_t t) { return m[f * L.T + t]; };
  // Every field but ROW_OFFSET (a wrapping key offset) is checked >= 0 first, so that the
  // bounds below can be compared as `a > limit - b` without any int64 overflow.
  for (int64_t t = 0; t < L.T; ++t) {
    for (int64_t f : {OUT_OFFSET, DIM, W_OFFSET, W_SIZE, ROW_OFFSET, NUM_ROWS}) {
      if (f != ROW_OFFSET && field(f, t) < 0) {
        fail(cat("robe: table_meta holds a negative entry (field ", f, ") for feature ", t));
      }
    }
    const int64_t pooling = field(POOLING, t);
    if (pooling != 0 && pooling != kPoolingMean) {
      fail(cat("robe: table_meta POOLING of feature ", t, " is ", pooling,
               "; expected 0 (sum) or 1 (mean)"));
    }
  }
  for (int64_t t = 0; t < L.T; ++t) {
    if (field(DIM, t) > out_dim - field(OUT_OFFSET, t)) {
      fail(cat("robe: output_dim ", out_dim, " is smaller than the features' dims"));
    }
  }
  for (int64_t t = 0; t < L.T; ++t) {
    if (field(W_SIZE, t) < Z || field(W_SIZE, t) > weights_numel - field(W_OFFSET, t)) {
      fail(cat("robe: every ROBE array must hold at least block_size=", Z,
               " floats and lie inside weights (", weights_numel, " floats)"));
    }
  }
  if (hash_mode == HASH_MIX) {
    for (int64_t t = 0; t < L.T; ++t) {
      if (field(W_SIZE, t) - Z + 1 >= (int64_t(1) << 32)) {
        fail("robe: the mix hash needs memory_size - block_size + 1 < 2**32");
      }
    }
  }
  L.feats.resize(L.T);
  for (int64_t t = 0; t < L.T; ++t) {
    Feature& f = L.feats[t];
    f.out_offset = field(OUT_OFFSET, t);
    f.dim = field(DIM, t);
    f.w_offset = field(W_OFFSET, t);
    f.w_size = field(W_SIZE, t);
    f.row_offset = field(ROW_OFFSET, t);
    f.num_rows = field(NUM_ROWS, t);
    f.mean = field(POOLING, t) == kPoolingMean;
    f.nblocks = f.dim / Z + (f.dim % Z != 0);  // ceil without overflowing near 2**63
    f.span = static_cast<uint64_t>(f.w_size - Z + 1);
    f.ref_d = std::min<uint64_t>(f.span, kPrime);
    f.ref_magic = std::numeric_limits<uint64_t>::max() / f.ref_d + 1;  // 0 for d == 1: fine
    L.max_dim = std::max(L.max_dim, f.dim);
    L.max_blocks = std::max(L.max_blocks, f.nblocks);
    L.sum_dim = f.dim > kI64Max - L.sum_dim ? kI64Max : L.sum_dim + f.dim;  // a work estimate only
  }
  return L;
}

// hashing.reference_key_limit: ((2**63 - 1 - C - max(nb - 1, 0) * B) // A) + 1 (floor division)
__int128 reference_key_limit(int64_t max_blocks, const std::vector<int64_t>& p) {
  const __int128 a = p[0], b = p[1], c = p[2];
  if (a == 0) fail("robe: reference hash parameter A must be non-zero");
  const __int128 n = static_cast<__int128>(kI64Max) - c - static_cast<__int128>(std::max<int64_t>(max_blocks - 1, 0)) * b;
  __int128 q = n / a;
  if (n % a != 0 && ((n < 0) != (a < 0))) q -= 1;
  return q + 1;
}

void check_hash_params(const std::vector<int64_t>& p) {
  if (p.size() != 3) fail(cat("robe: hash_params must hold 3 integers, got ", p.size()));
}

RefHash make_ref_hash(const std::vector<int64_t>& p) {
  RefHash h;
  h.a = static_cast<uint64_t>(p[0]);
  h.c = static_cast<uint64_t>(p[2]);
  int64_t bm = p[1] % static_cast<int64_t>(kPrime);
  if (bm < 0) bm += static_cast<int64_t>(kPrime);
  h.b_mod = static_cast<uint64_t>(bm);
  h.steps[0] = 0;
  for (int64_t blk = 1; blk < RefHash::kMaxStartsBlocks; ++blk) {
    const uint64_t next = h.steps[blk - 1] + h.b_mod;
    h.steps[blk] = next >= kPrime ? next - kPrime : next;
  }
  return h;
}

MixHash make_mix_hash(const std::vector<int64_t>& p) { return MixHash{static_cast<uint64_t>(p[0])}; }

template <typename F>
void dispatch_hash(int64_t hash_mode, const std::vector<int64_t>& params, F&& f) {
  if (hash_mode == HASH_REFERENCE) {
    f(make_ref_hash(params));
  } else {
    f(make_mix_hash(params));
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  if (!t.device().is_cpu()) fail(cat("robe: the C++ CPU kernel got ", name, " on ", t.device()));
}

// offsets[0] == 0 and offsets[-1] == N (the O(1) checks, done before any loop).
template <typename index_t>
void check_offset_ends(const index_t* offs, int64_t n_offs, int64_t N) {
  const int64_t first = offs[0], last = offs[n_offs - 1];
  if (first != 0) fail(cat("robe: offsets[0] must be 0, got ", first));
  if (last != N) {
    fail(cat("robe: offsets[-1] = ", last, " but values has ", N,
             " entries (lengths do not match values)"));
  }
}

template <typename index_t>
[[noreturn]] void fail_offsets_decrease(const index_t* offs, int64_t bag, int64_t B) {
  const int64_t b = std::max<int64_t>(B, 1);
  fail(cat("robe: offsets decrease at bag ", bag, " (feature ", bag / b, ", sample ", bag % b, "): ",
           static_cast<int64_t>(offs[bag]), " -> ", static_cast<int64_t>(offs[bag + 1])));
}

// All offset checks in one serial pass (used by the backward ops before they index values).
template <typename index_t>
void check_offsets_full(const index_t* offs, int64_t n_offs, int64_t N, int64_t B) {
  check_offset_ends(offs, n_offs, N);
  for (int64_t i = 0; i + 1 < n_offs; ++i) {
    if (offs[i + 1] < offs[i]) fail_offsets_decrease(offs, i, B);
  }
}

template <typename index_t>
int64_t feature_of_position(const index_t* offs, const Layout& L, int64_t pos) {
  for (int64_t t = 0; t < L.T; ++t) {
    if (pos < static_cast<int64_t>(offs[(t + 1) * L.B])) return t;
  }
  return L.T - 1;
}

template <typename index_t>
void raise_loop_errors(const LoopErrors& err, const index_t* offs, const index_t* vals,
                       const at::Tensor& psw, const Layout& L, int64_t bounds_check,
                       const std::string& limit_str) {
  if (err.offsets.any()) fail_offsets_decrease(offs, err.offsets.get(), L.B);
  if (err.psw.any()) {
    const int64_t pos = err.psw.get();
    const double v = psw.reshape(-1)[pos].item<double>();
    fail(cat("robe: per_sample_weights[", pos, "] is ", py_float_str(v), "; weights must be finite"));
  }
  if (err.ids.any()) {
    const int64_t pos = err.ids.get();
    const int64_t t = feature_of_position(offs, L, pos);
    const int64_t id = vals[pos];
    if (bounds_check == BOUNDS_ERROR) {
      fail(cat("robe: id ", id, " at position ", pos, " of feature ", t, " is out of range [0, ",
               L.feats[t].num_rows, ")", kRawIdsHint));
    }
    fail(cat("robe: id ", id, " at position ", pos, " of feature ", t,
             " cannot be hashed by the reference hash (keys must lie in [0, ", limit_str,
             "); use hash='mix' for arbitrary 64-bit ids)"));
  }
}

at::ScalarType acc_type_of(at::ScalarType w) { return w == at::kDouble ? at::kDouble : at::kFloat; }

// The backward ops' weights (the fused one's included), refused unless floating point (the
// forward checks its own in parse_layout); returns their dtype.
at::ScalarType checked_weights_dtype(const at::Tensor& weights) {
  const at::ScalarType wst = weights.scalar_type();
  if (wst != at::kFloat && wst != at::kDouble && wst != at::kHalf && wst != at::kBFloat16) {
    fail(cat("robe: weights must be a floating point tensor, got ", wst));
  }
  return wst;
}

}  // namespace
}  // namespace robe
