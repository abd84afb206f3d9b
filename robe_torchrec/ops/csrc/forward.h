// The pooled forward's kernel, a template over what it does (ForwardMode): forward.cpp
// builds the forward itself (FULL); forward_parts.cpp, built only for the benchmarks, its
// profiling aids.

#pragma once

#include "layout.h"
#include "loops.h"

namespace robe {
namespace {

// ---------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------

enum IdCheck { CHECK_RANGE = 0, CHECK_REF_LIMIT = 1, CHECK_NONE = 2 };
// Copies a finished output row out of the thread's row buffer. Large outputs use
// non-temporal stores: they do not fit in cache anyway, and streaming them skips the read
// for ownership that a plain store of a cold line costs (half of the output traffic). Where
// the CPU has 512-bit stores, one writes a whole line, where a 256-bit store writes half of
// one (measured faster at 1 and 2 threads, bitwise equal: docs/benchmarks.md).
#if defined(__AVX512F__)
constexpr int64_t kStreamBytesPerStore = 64;  // one 512-bit store: a whole cache line
inline void stream_vector(float* dst, const float* src) { _mm512_stream_ps(dst, _mm512_loadu_ps(src)); }
inline void stream_vector(double* dst, const double* src) { _mm512_stream_pd(dst, _mm512_loadu_pd(src)); }
#elif defined(__AVX__)
constexpr int64_t kStreamBytesPerStore = 32;
inline void stream_vector(float* dst, const float* src) { _mm256_stream_ps(dst, _mm256_loadu_ps(src)); }
inline void stream_vector(double* dst, const double* src) { _mm256_stream_pd(dst, _mm256_loadu_pd(src)); }
#endif

template <typename scalar_t, typename acc_t>
inline void store_row(scalar_t* __restrict__ dst, const acc_t* __restrict__ src, int64_t n, bool stream) {
#ifdef __AVX__
  if constexpr (std::is_same_v<scalar_t, acc_t> &&
                (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, double>)) {
    if (stream) {
      constexpr int64_t kWidth = kStreamBytesPerStore / sizeof(scalar_t);  // one vector
      int64_t j = 0;
      for (; j < n && (reinterpret_cast<uintptr_t>(dst + j) & (kStreamBytesPerStore - 1)) != 0; ++j) dst[j] = src[j];
      for (; j + kWidth <= n; j += kWidth) stream_vector(dst + j, src + j);
      for (; j < n; ++j) dst[j] = src[j];
      return;
    }
  }
#endif
  (void)stream;
  for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<scalar_t>(src[j]);
}

inline void store_fence() {
#ifdef __AVX__
  _mm_sfence();
#endif
}

// A core's L2 cache as this CPU reports it (512 KiB where it does not), read once when the
// library loads, not in a function-local static, whose guard the forward would check on every
// call. The forward prefetches its blocks from arrays larger than this: the gathers from a
// smaller one hit the caches anyway, and prefetching them costs time there (measured on
// 512 KiB and 1 MiB arrays: docs/benchmarks.md).
int64_t reported_l2_bytes() {
  const long reported = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return reported > 0 ? static_cast<int64_t>(reported) : int64_t(512) << 10;
}
const int64_t kL2Bytes = reported_l2_bytes();

// Whether the forward prefetches the blocks it gathers from an array of weights_bytes
// (also exported, for the tests).
inline bool forward_prefetches(int64_t weights_bytes) { return weights_bytes > kL2Bytes; }

// Arrays beyond this go through the backward scatter's window (see ScatterWindow; measured with
// Outputs at least this large are written with non-temporal stores.
constexpr int64_t kStreamBytes = int64_t(1) << 21;

// What forward_kernel does: the forward, or one of its profiling aids (the benchmark times
// them against the forward to split its time: hashing, gathering, storing).
enum class ForwardMode {
  FULL,        // hash, gather, pool, store the output
  HASH_ONLY,   // pass 1 alone (loops, checks, hashes, the tile's buffers), no prefetches,
               // no gathers, no output
  GATHER_ONLY  // all of FULL but the output stores: each pooled row is added to one of its
               // chunk's kGatherSinks cache-resident [out_dim] sums, in turn; returns them
               // all added up
};

// GATHER_ONLY's sums per chunk. With one, each row's add would wait on the previous row's (a
// chain through memory the forward does not have); rows added in turn to 8 sums are
// independent, as the forward's stores are.
constexpr int64_t kGatherSinks = 8;

// One tile's hashed lookups, pass 1's output and pass 2's input: the next tile is hashed
// (and its weights prefetched) before this one is gathered, so every prefetch has a whole
// tile of work to land.
template <typename acc_t>
struct TileBuf {
  std::vector<int64_t> starts;  // flat weight index of each valid (value, block)
  std::vector<acc_t> scales;    // scale of each valid value
  std::vector<int64_t> counts;  // valid values of each bag (sample-major)
};

// Room for `more` entries after the cursor `at` of v (grown by doubling); returns the cursor,
// which growing moves.
template <typename T>
inline T* room_for(std::vector<T>& v, T* at, int64_t more) {
  const size_t used = static_cast<size_t>(at - v.data());
  if (used + static_cast<size_t>(more) > v.size()) {
    v.resize(std::max(2 * v.size(), used + static_cast<size_t>(more)));
  }
  return v.data() + used;
}

// Pass 1 of the forward for samples [b0, b1): checks each value (recording the first bad
// one in err), computes its scale, hashes its blocks and, if `prefetch`, prefetches them,
// into buf (in HASH_ONLY mode too, as the forward does, then returns the sum of the tile's
// block starts: a running sum per block would be a dependency chain the forward does not
// have). kStarts: a value's starts in one loop (Hash::starts), then their prefetches. A
// function of its own with its cursors in locals: as pool_tile, not a lambda's captured
// references.
template <typename scalar_t, typename acc_t, typename index_t, typename Hash, ForwardMode kMode,
          bool kStarts>
uint64_t hash_values(const scalar_t* __restrict__ w, const index_t* __restrict__ vals,
                     const index_t* __restrict__ offs, const acc_t* __restrict__ psw, int64_t b0, int64_t b1,
                     const Layout& L, const Hash& hash, int64_t N, IdCheck id_check, int64_t max_key,
                     bool prefetch, LoopErrors& err, TileBuf<acc_t>& buf) {
  const int64_t B = L.B, T = L.T, Z = L.Z;
  uint64_t sum = 0;
  int64_t* st = buf.starts.data();
  acc_t* sc = buf.scales.data();
  int64_t* cn = buf.counts.data();
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const Feature& f = L.feats[t];
      const int64_t bag = t * B + b;
      const int64_t s = offs[bag], e = offs[bag + 1];
      int64_t valid = 0;
      if (e < s) {
        err.offsets.record(bag);
      } else if (s >= 0 && e <= N) {  // else: offsets decrease elsewhere, reported there
        const acc_t len = static_cast<acc_t>(e - s);
        const scalar_t* wf = w + f.w_offset;
        st = room_for(buf.starts, st, (e - s) * f.nblocks);
        sc = room_for(buf.scales, sc, e - s);
        for (int64_t p = s; p < e; ++p) {
          const int64_t id = static_cast<int64_t>(vals[p]);
          const uint64_t key = f.key(id);
          if (id_check == CHECK_RANGE) {
            if (id < 0 || id >= f.num_rows) {
              err.ids.record(p);
              continue;
            }
          } else if (id_check == CHECK_REF_LIMIT) {
            if (id < 0 || static_cast<int64_t>(key) > max_key) {
              err.ids.record(p);
              continue;
            }
          }
          acc_t scale = acc_t(1);
          if (psw != nullptr) {
            scale = psw[p];
            if (!std::isfinite(scale)) {
              err.psw.record(p);
              continue;
            }
          }
          if (f.mean) scale = scale / len;
          ++valid;
          *sc++ = scale;
          if constexpr (kStarts) {
            // the starts first, the prefetches after: a loop of hashes and stores alone
            // vectorizes (see forward_kernel)
            hash.starts(key, f, f.w_offset, st);
            if (prefetch) {
              for (int64_t blk = 0; blk < f.nblocks; ++blk) prefetch_block(w + st[blk], std::min(Z, f.dim - blk * Z));
            }
            st += f.nblocks;
          } else {
            hash.blocks(key, f, [&](int64_t blk, uint64_t start) {
              if (prefetch) prefetch_block(wf + start, std::min(Z, f.dim - blk * Z));
              *st++ = f.w_offset + static_cast<int64_t>(start);
            });
          }
        }
      }
      *cn++ = valid;
    }
  }
  if constexpr (kMode == ForwardMode::HASH_ONLY) {
    for (const int64_t* p = buf.starts.data(); p < st; ++p) sum += static_cast<uint64_t>(*p);
  }
  return sum;
}

// Pass 2 of the forward for samples [b0, b1): pools each row in `row` from its hashed block
// starts (st), value scales (sc) and valid-value counts (cn), then stores it to out (in
// GATHER_ONLY mode: adds it to sum b % kGatherSinks of those after the row). A function of
// its own with restrict pointers: inside forward_kernel's lambda the compiler kept the
// cursors on the stack and reloaded them around every block.
template <typename scalar_t, typename acc_t, ForwardMode kMode>
void pool_tile(const scalar_t* __restrict__ w, const int64_t* __restrict__ st, const acc_t* __restrict__ sc,
               const int64_t* __restrict__ cn, int64_t b0, int64_t b1, const Layout& L, acc_t* __restrict__ row,
               acc_t* __restrict__ out, int64_t out_dim, bool stream) {
  const int64_t T = L.T, Z = L.Z;
  for (int64_t b = b0; b < b1; ++b) {
    std::fill(row, row + out_dim, acc_t(0));
    for (int64_t t = 0; t < T; ++t) {
      const Feature& f = L.feats[t];
      const int64_t D = f.dim, nb = f.nblocks;
      acc_t* __restrict__ acc = row + f.out_offset;
      const int64_t valid = *cn++;
      with_block_length<std::is_same_v<scalar_t, float>>(Z, D % Z == 0, [&](auto z_tag) {
        constexpr int64_t kZ = decltype(z_tag)::value;
        for (int64_t i = 0; i < valid; ++i) {
          const acc_t scale = *sc++;
          for (int64_t blk = 0; blk < nb; ++blk) {
            if constexpr (kZ > 0) {
              add_scaled_fixed<kZ>(acc + blk * kZ, w + *st++, scale);
            } else {
              add_scaled(acc + blk * Z, w + *st++, std::min(Z, D - blk * Z), scale);
            }
          }
        }
      });
    }
    if constexpr (kMode == ForwardMode::GATHER_ONLY) {
      acc_t* __restrict__ sink = row + out_dim * (1 + b % kGatherSinks);
#pragma omp simd
      for (int64_t j = 0; j < out_dim; ++j) sink[j] += row[j];
    } else {
      store_row(out + b * out_dim, row, out_dim, stream);
    }
  }
}

template <typename scalar_t, typename acc_t, typename index_t, typename Hash, ForwardMode kMode>
uint64_t forward_kernel(const scalar_t* __restrict__ w, const index_t* __restrict__ vals,
                        const index_t* __restrict__ offs, const acc_t* __restrict__ psw,
                        acc_t* __restrict__ out, int64_t out_dim, const Layout& L, const Hash& hash,
                        int64_t N, int64_t weights_numel, IdCheck id_check, int64_t max_key, LoopErrors& err) {
  const int64_t B = L.B, T = L.T;
  // work per sample ~ its multiply-adds; at least ~32k of them per task
  const int64_t avg_dim = std::max<int64_t>(L.sum_dim / std::max<int64_t>(T, 1), 1);
  const int64_t work_per_sample = std::max<int64_t>(1, N * avg_dim / std::max<int64_t>(B, 1) + T * 4);
  const int64_t grain = std::max<int64_t>(1, 32768 / work_per_sample);
  const int64_t entries_per_sample = std::max<int64_t>(1, N * std::max<int64_t>(L.max_blocks, 1) / std::max<int64_t>(B, 1));
  const int64_t tile = std::clamp<int64_t>(kTileEntries / entries_per_sample, 1, 256);
  const bool stream = B * out_dim * static_cast<int64_t>(sizeof(acc_t)) >= kStreamBytes;
  const bool prefetch = kMode != ForwardMode::HASH_ONLY &&
                        forward_prefetches(weights_numel * static_cast<int64_t>(sizeof(scalar_t)));
  // A value's blocks can hash independently of each other (Hash::starts): when every feature
  // has more than two, the hash pass writes a value's starts in one loop that vectorizes,
  // then prefetches them. With two blocks or fewer the mix hash was slower that way, so there
  // the pass hashes, prefetches and stores block by block (the reference hash follows the
  // same rule; its starts() covers up to kMaxStartsBlocks blocks). Measured with both hashes:
  // docs/benchmarks.md.
  bool starts_first = std::all_of(L.feats.begin(), L.feats.end(), [](const Feature& f) { return f.nblocks > 2; });
  if constexpr (std::is_same_v<Hash, RefHash>) {
    starts_first = starts_first && L.max_blocks <= RefHash::kMaxStartsBlocks;
  }
  std::atomic<uint64_t> checksum{0};
  parallel_for_dynamic(B, dynamic_chunk(B, grain), [&](int64_t b0, int64_t b1) {
    // GATHER_ONLY: the kGatherSinks sums of out_dim elements after the row add up this
    // chunk's pooled rows, in place of their stores. (The aid names no new local in the
    // lambdas: a lambda captures what a discarded `if constexpr` branch names too, and that
    // changed FULL's machine code.)
    std::vector<acc_t> row_buf(static_cast<size_t>(std::max<int64_t>(out_dim, 1)) *
                               (kMode == ForwardMode::GATHER_ONLY ? 1 + kGatherSinks : 1));
    acc_t* __restrict__ row = row_buf.data();
    TileBuf<acc_t> bufs[2];
    for (TileBuf<acc_t>& tb : bufs) tb.counts.resize(static_cast<size_t>(tile * T));
    uint64_t local_sum = 0;

    // pass 1 of samples [tb0, tb1)
    auto hash_tile = [&](int64_t tb0, int64_t tb1, TileBuf<acc_t>& buf) {
      if (starts_first) {
        local_sum += hash_values<scalar_t, acc_t, index_t, Hash, kMode, true>(
            w, vals, offs, psw, tb0, tb1, L, hash, N, id_check, max_key, prefetch, err, buf);
        return;
      }
      local_sum += hash_values<scalar_t, acc_t, index_t, Hash, kMode, false>(
          w, vals, offs, psw, tb0, tb1, L, hash, N, id_check, max_key, prefetch, err, buf);
    };

    // pass 2 of samples [tb0, tb1)
    auto gather_tile = [&](int64_t tb0, int64_t tb1, const TileBuf<acc_t>& buf) {
      pool_tile<scalar_t, acc_t, kMode>(w, buf.starts.data(), buf.scales.data(), buf.counts.data(), tb0, tb1, L,
                                        row, out, out_dim, stream);
    };

    if constexpr (kMode == ForwardMode::HASH_ONLY) {
      for (int64_t tb0 = b0; tb0 < b1; tb0 += tile) hash_tile(tb0, std::min(b1, tb0 + tile), bufs[0]);
      checksum.fetch_add(local_sum, std::memory_order_relaxed);
    } else {
      int cur = 0;
      if (b0 < b1) hash_tile(b0, std::min(b1, b0 + tile), bufs[cur]);
      for (int64_t tb0 = b0; tb0 < b1; tb0 += tile) {
        const int64_t tb1 = std::min(b1, tb0 + tile);
        if (tb1 < b1) hash_tile(tb1, std::min(b1, tb1 + tile), bufs[cur ^ 1]);
        gather_tile(tb0, tb1, bufs[cur]);
        cur ^= 1;
      }
      if constexpr (kMode == ForwardMode::GATHER_ONLY) {
        static std::atomic_flag merging = ATOMIC_FLAG_INIT;  // the chunks add into out in turn
        while (merging.test_and_set(std::memory_order_acquire)) {
        }
        for (int64_t k = 1; k <= kGatherSinks; ++k) {
          for (int64_t j = 0; j < out_dim; ++j) out[j] += row[k * out_dim + j];
        }
        merging.clear(std::memory_order_release);
      } else {
        store_fence();
      }
    }
  });
  return checksum.load();
}

template <ForwardMode kMode>
at::Tensor forward_impl(const at::Tensor& weights_in, const at::Tensor& values_in,
                        const at::Tensor& offsets_in, const std::optional<at::Tensor>& psw_in,
                        const at::Tensor& table_meta, int64_t output_dim, int64_t block_size,
                        int64_t hash_mode, const std::vector<int64_t>& hash_params,
                        int64_t bounds_check) {
  check_cpu(weights_in, "weights");
  check_cpu(values_in, "values");
  check_cpu(offsets_in, "offsets");
  check_hash_params(hash_params);
  if (values_in.scalar_type() != offsets_in.scalar_type()) {
    fail(cat("robe: offsets dtype ", offsets_in.scalar_type(), " must equal values dtype ", values_in.scalar_type()));
  }
  const at::Tensor weights = weights_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t N = values.numel();
  if (bounds_check != BOUNDS_ERROR && bounds_check != BOUNDS_UNBOUNDED) {
    fail(cat("robe: bounds_check must be 0 (error) or 1 (unbounded), got ", bounds_check));
  }
  const Layout L = parse_layout(table_meta, output_dim, block_size, weights.numel(), hash_mode, offsets.numel());
  const at::ScalarType acc_st = acc_type_of(weights.scalar_type());
  if (kMode == ForwardMode::FULL && L.B > 0 && output_dim > kI64Max / 8 / L.B) {
    fail(cat("robe: the output of ", L.B, " samples x output_dim ", output_dim,
             " elements is too large to allocate"));
  }
  at::Tensor psw;
  if (psw_in.has_value() && psw_in->defined()) {
    check_cpu(*psw_in, "per_sample_weights");
    if (psw_in->numel() != N) {
      fail(cat("robe: per_sample_weights has ", psw_in->numel(), " entries but values has ", N));
    }
    psw = psw_in->to(acc_st).contiguous();
  }
  IdCheck id_check = CHECK_NONE;
  int64_t max_key = kI64Max;
  std::string limit_str;
  if (bounds_check == BOUNDS_ERROR) {
    id_check = CHECK_RANGE;
  } else if (hash_mode == HASH_REFERENCE) {
    id_check = CHECK_REF_LIMIT;
    const __int128 limit = reference_key_limit(L.max_blocks, hash_params);
    limit_str = i128_str(limit);
    const __int128 mk = limit - 1, lo = std::numeric_limits<int64_t>::min();
    max_key = static_cast<int64_t>(mk > kI64Max ? kI64Max : (mk < lo ? lo : mk));
  }
  at::Tensor out;
  if constexpr (kMode == ForwardMode::HASH_ONLY) {
    out = at::zeros({}, values.options().dtype(at::kLong));
  } else if constexpr (kMode == ForwardMode::GATHER_ONLY) {
    out = at::zeros({output_dim}, weights.options().dtype(acc_st));
  } else {
    out = at::empty({L.B, output_dim}, weights.options().dtype(acc_st));
  }
  LoopErrors err;
  uint64_t checksum = 0;
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "robe_forward_index", [&] {
    const index_t* offs = offsets.data_ptr<index_t>();
    check_offset_ends(offs, offsets.numel(), N);
    const index_t* vals = values.data_ptr<index_t>();
    auto run = [&](auto scalar_tag) {
      using scalar_t = decltype(scalar_tag);
      using acc_t = at::opmath_type<scalar_t>;
      const acc_t* pswp = psw.defined() ? psw.data_ptr<acc_t>() : nullptr;
      // pooled in acc_t and returned in it: low-precision weights give float32 output (as
      // FBGEMM's TBE with output_dtype FP32), no second rounding of the sums
      acc_t* outp = kMode == ForwardMode::HASH_ONLY ? nullptr : out.data_ptr<acc_t>();
      dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
        using Hash = std::decay_t<decltype(hash)>;
        checksum = forward_kernel<scalar_t, acc_t, index_t, Hash, kMode>(
            weights.data_ptr<scalar_t>(), vals, offs, pswp, outp, output_dim, L, hash, N, weights.numel(),
            id_check, max_key, err);
      });
    };
    if constexpr (kMode != ForwardMode::FULL) {  // the benchmark aids only need one weight type
      if (weights.scalar_type() != at::kFloat) {
        fail(kMode == ForwardMode::HASH_ONLY ? "robe: forward_hash_only takes float32 weights"
                                             : "robe: forward_gather_only takes float32 weights");
      }
      run(float{});
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weights.scalar_type(), "robe_forward",
                                      [&] { run(scalar_t{}); });
    }
    raise_loop_errors(err, offs, vals, psw, L, bounds_check, limit_str);
  });
  if constexpr (kMode == ForwardMode::HASH_ONLY) out.fill_(static_cast<int64_t>(checksum));
  return out;
}

}  // namespace
}  // namespace robe
