// The backward: the dense weight gradient (torch.ops.<ext>.backward_dense), the fused
// backward + optimizer step (backward_fused_, with the update rules of optimizers.h) and the
// per-sample-weight gradient. The first two share the scatter plan below.

#include "layout.h"
#include "loops.h"
#include "ops.h"
#include "optimizers.h"

namespace robe {
namespace {

// ---------------------------------------------------------------------------------------
// backward: the scatter plan shared by backward_dense and backward_fused_
//
// Phase 1 (parallel over fixed chunks of values) hashes every (value, block) once into a
//   record {dst, src, scale, len} and counts, per chunk, the records that touch each
//   destination range of the flat weights (ranges of RS = 2**k floats, cache sized).
// Phase 1b (parallel over chunks) scatters the records into per-range buckets, in chunk
//   order, so each bucket lists its records in value order (a block straddling two ranges
//   goes to both).
// Phase 2 (caller, parallel over ranges) adds each bucket into its own range only: no races,
//   and each weight's sum runs in value order whatever the thread count (deterministic).
// ---------------------------------------------------------------------------------------

template <typename acc_t>
struct Rec {
  int64_t dst;  // first flat weight index of the block
  int64_t src;  // first grad_output element of the block
  acc_t scale;  // per-sample weight / bag length (MEAN)
  int32_t len;  // elements in the block (the last block of a row may be partial)
};

// Scratch memory reused across calls by the calling thread: fresh multi-megabyte buffers
// would be page-faulted in (and zeroed by the kernel) on every call.
struct Scratch {
  std::unique_ptr<char[]> data;
  size_t capacity = 0;
  static constexpr size_t kKeepBytes = size_t(256) << 20;  // larger buffers are not kept
  template <typename T>
  T* get(size_t n) {
    static_assert(std::is_trivially_destructible_v<T>);
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    if (bytes > capacity || (capacity > kKeepBytes && bytes <= kKeepBytes)) {
      data.reset();
      data.reset(new char[bytes]);  // new[] of char: aligned for any fundamental type
      capacity = bytes;
    }
    return reinterpret_cast<T*>(data.get());
  }
  void trim() {
    if (capacity > kKeepBytes) {
      data.reset();
      capacity = 0;
    }
  }
};
thread_local Scratch t_records, t_sorted, t_direct;  // t_direct: the direct scatter's gradient

template <typename acc_t>
struct Plan {
  Rec<acc_t>* sorted = nullptr;  // t_sorted's memory (valid until the next plan)
  std::vector<int64_t> bucket_begin;  // R + 1
  int64_t R = 0, log2_rs = 0, rs = 0;
};

template <typename acc_t, typename index_t, typename Hash>
Plan<acc_t> build_plan(const index_t* offs, const index_t* vals, const acc_t* psw, const Layout& L,
                       const Hash& hash, int64_t N, int64_t weights_numel, int64_t ldg) {
  const int64_t B = L.B, T = L.T, Z = L.Z;
  Plan<acc_t> plan;
  // destination ranges: power of two >= max(16384, Z, numel / 4096)
  int64_t rs_min = std::max<int64_t>({16384, Z, (weights_numel + 4095) / 4096});
  int64_t lg = 0;
  while ((int64_t(1) << lg) < rs_min) ++lg;
  plan.log2_rs = lg;
  plan.rs = int64_t(1) << lg;
  plan.R = std::max<int64_t>(1, (weights_numel + plan.rs - 1) / plan.rs);
  const int64_t R = plan.R;

  // entry (record) index of the first value of each feature
  std::vector<int64_t> vbeg(T), ebeg(T + 1);
  ebeg[0] = 0;
  for (int64_t t = 0; t < T; ++t) {
    vbeg[t] = offs[t * B];
    ebeg[t + 1] = ebeg[t] + (static_cast<int64_t>(offs[(t + 1) * B]) - vbeg[t]) * L.feats[t].nblocks;
  }
  const int64_t E = ebeg[T];
  // fixed chunks (independent of the thread count: results do not depend on it)
  int64_t C = std::min<int64_t>({64, std::max<int64_t>(1, (N + 2047) / 2048),
                                 std::max<int64_t>(1, (int64_t(1) << 20) / R)});
  if (N == 0) C = 0;
  const int64_t vpc = C > 0 ? (N + C - 1) / C : 0;
  std::vector<int64_t> hist(static_cast<size_t>(C * R), 0), chunk_e0(C + 1, E);
  Rec<acc_t>* recs = t_records.get<Rec<acc_t>>(static_cast<size_t>(E));

  auto entry_of = [&](int64_t p, int64_t bag) {
    const int64_t t = bag / B;
    return ebeg[t] + (p - vbeg[t]) * L.feats[t].nblocks;
  };
  auto bag_of = [&](int64_t p) {  // bag holding value p (offsets validated, p < N)
    return static_cast<int64_t>(std::upper_bound(offs, offs + T * B + 1, static_cast<index_t>(p)) - offs) - 1;
  };

  parallel_for_dynamic(C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t p0 = c * vpc, p1 = std::min(N, p0 + vpc);
      if (p0 >= p1) {
        chunk_e0[c] = -1;  // empty chunk: fixed below
        continue;
      }
      int64_t* h = hist.data() + c * R;
      int64_t bag = bag_of(p0);
      int64_t e = entry_of(p0, bag);
      chunk_e0[c] = e;
      int64_t bag_end = offs[bag + 1];
      const Feature* f = &L.feats[bag / B];
      int64_t sample = bag % B;
      acc_t len = acc_t(1);
      auto set_bag = [&]() {
        f = &L.feats[bag / B];
        sample = bag % B;
        len = static_cast<acc_t>(static_cast<int64_t>(offs[bag + 1]) - static_cast<int64_t>(offs[bag]));
      };
      set_bag();
      for (int64_t p = p0; p < p1; ++p) {
        if (p >= bag_end) {
          do {
            ++bag;
            bag_end = offs[bag + 1];
          } while (bag_end <= p);
          set_bag();
        }
        const acc_t scale = value_scale(psw, p, *f, len);
        const uint64_t key = f->key(static_cast<int64_t>(vals[p]));
        const int64_t src0 = sample * ldg + f->out_offset;
        const int64_t D = f->dim, w0 = f->w_offset;
        hash.blocks(key, *f, [&](int64_t blk, uint64_t start) {
          Rec<acc_t>& r = recs[e++];
          r.dst = w0 + static_cast<int64_t>(start);
          r.src = src0 + blk * Z;
          r.scale = scale;
          r.len = static_cast<int32_t>(std::min(Z, D - blk * Z));
          const int64_t ra = r.dst >> lg, rb = (r.dst + r.len - 1) >> lg;
          for (int64_t q = ra; q <= rb; ++q) ++h[q];
        });
      }
    }
  });
  // chunks with no values start where the next one does
  chunk_e0[C] = E;
  for (int64_t c = C - 1; c >= 0; --c) {
    if (chunk_e0[c] < 0) chunk_e0[c] = chunk_e0[c + 1];
  }

  // prefix sums: bucket r holds chunk 0's records, then chunk 1's, ...
  plan.bucket_begin.assign(R + 1, 0);
  std::vector<int64_t> cursor(static_cast<size_t>(C * R));
  int64_t total = 0;
  for (int64_t r = 0; r < R; ++r) {
    plan.bucket_begin[r] = total;
    for (int64_t c = 0; c < C; ++c) {
      cursor[c * R + r] = total;
      total += hist[c * R + r];
    }
  }
  plan.bucket_begin[R] = total;
  plan.sorted = t_sorted.get<Rec<acc_t>>(static_cast<size_t>(total));
  parallel_for_dynamic(C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cur = cursor.data() + c * R;
      for (int64_t i = chunk_e0[c]; i < chunk_e0[c + 1]; ++i) {
        const Rec<acc_t>& r = recs[i];
        const int64_t ra = r.dst >> lg, rb = (r.dst + r.len - 1) >> lg;
        for (int64_t q = ra; q <= rb; ++q) plan.sorted[cur[q]++] = r;
      }
    }
  });
  t_records.trim();
  return plan;
}

// Adds bucket r of the plan into buf (which holds the weights [lo, hi)).
template <typename acc_t>
inline void accumulate_bucket(const Plan<acc_t>& plan, int64_t r, int64_t lo, int64_t hi,
                              const acc_t* __restrict__ go, acc_t* __restrict__ buf) {
  constexpr int64_t kAhead = 16;  // records whose grad_output rows are prefetched ahead
  const Rec<acc_t>* recs = plan.sorted;
  const int64_t i0 = plan.bucket_begin[r], i1 = plan.bucket_begin[r + 1];
  for (int64_t i = i0; i < std::min(i1, i0 + kAhead); ++i) prefetch_block(go + recs[i].src, recs[i].len);
  for (int64_t i = i0; i < i1; ++i) {
    if (i + kAhead < i1) prefetch_block(go + recs[i + kAhead].src, recs[i + kAhead].len);
    const Rec<acc_t>& rec = recs[i];
    const int64_t a = std::max(rec.dst, lo), b = std::min(rec.dst + rec.len, hi);
    const acc_t* __restrict__ g = go + rec.src + (a - rec.dst);
    acc_t* __restrict__ o = buf + (a - lo);
    const acc_t s = rec.scale;
    add_scaled(o, g, b - a, s);
  }
}

struct BackwardInputs {
  at::Tensor grad_output, values, offsets, psw;
  Layout L;
  int64_t N = 0;
  int64_t ldg = 0;  // grad_output's row stride (its columns are contiguous)
};

BackwardInputs prepare_backward(const at::Tensor& grad_output, const at::Tensor& weights,
                                const at::Tensor& values, const at::Tensor& offsets,
                                const std::optional<at::Tensor>& psw_in, const at::Tensor& table_meta,
                                int64_t block_size, int64_t hash_mode,
                                const std::vector<int64_t>& hash_params, at::ScalarType acc_st) {
  check_cpu(grad_output, "grad_output");
  check_cpu(weights, "weights");
  check_cpu(values, "values");
  check_cpu(offsets, "offsets");
  check_hash_params(hash_params);
  if (values.scalar_type() != offsets.scalar_type()) {
    fail(cat("robe: offsets dtype ", offsets.scalar_type(), " must equal values dtype ", values.scalar_type()));
  }
  if (grad_output.dim() != 2) fail(cat("robe: grad_output must be 2-D [B, output_dim], got ", grad_output.dim(), " dims"));
  BackwardInputs in;
  in.L = parse_layout(table_meta, grad_output.size(1), block_size, weights.numel(), hash_mode, offsets.numel());
  if (grad_output.size(0) != in.L.B) {
    fail(cat("robe: grad_output has ", grad_output.size(0), " rows but the offsets describe ", in.L.B, " samples"));
  }
  // Rows may have any stride, 0 included: the gradient of sum(output) is one row broadcast to
  // all B, and copying it out would cost more than the whole scatter (16 MiB for the pair model).
  in.grad_output = grad_output.to(acc_st);
  if (in.grad_output.size(1) > 1 && in.grad_output.stride(1) != 1) {
    in.grad_output = in.grad_output.stride(0) == 0 && in.grad_output.size(0) > 0  // a broadcast scalar: one row
                         ? in.grad_output.narrow(0, 0, 1).contiguous().expand(in.grad_output.sizes())
                         : in.grad_output.contiguous();
  }
  in.ldg = in.grad_output.stride(0);
  in.values = values.contiguous();
  in.offsets = offsets.contiguous();
  in.N = in.values.numel();
  if (psw_in.has_value() && psw_in->defined()) {
    check_cpu(*psw_in, "per_sample_weights");
    if (psw_in->numel() != in.N) {
      fail(cat("robe: per_sample_weights has ", psw_in->numel(), " entries but values has ", in.N));
    }
    in.psw = psw_in->to(acc_st).contiguous();
  }
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_check_offsets", [&] {
    check_offsets_full(in.offsets.data_ptr<index_t>(), in.offsets.numel(), in.N, in.L.B);
  });
  return in;
}

// Runs fn(plan) with the plan of the inputs, dispatched on acc_t (float/double) and index_t.
template <typename acc_t, typename Fn>
void with_plan(const BackwardInputs& in, int64_t weights_numel, int64_t hash_mode,
               const std::vector<int64_t>& hash_params, Fn&& fn) {
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_backward_plan", [&] {
    const acc_t* pswp = in.psw.defined() ? in.psw.data_ptr<acc_t>() : nullptr;
    dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
      Plan<acc_t> plan = build_plan<acc_t>(in.offsets.data_ptr<index_t>(), in.values.data_ptr<index_t>(),
                                           pswp, in.L, hash, in.N, weights_numel, in.ldg);
      fn(plan);
      t_sorted.trim();
    });
  });
}

// The scatter without a plan, on one thread: every (value, block) is added straight into buf
// (the gradient of the whole flat weights) in value order and block order, the order in which
// the plan's buckets add them, so each sum is bitwise the plan's (a test compares 1 and 2
// threads with 3). It skips writing, counting and sorting the records. Arrays beyond
// kScatterWindowMinBytes (and grad_output rows beyond a page, see direct_scatter_windowed) go
// through a ScatterWindow: a block's destination and gradient lines are prefetched a window of
// blocks before it is added, so its misses overlap the others' instead of each stalling the loop.
//
// When the backward takes it instead of the plan (use_direct_scatter) is a measured choice,
// stated in bytes of the whole-array gradient (weights_numel x its accumulator's bytes) per
// thread count. Past its limit the direct path zeroes and steps a gradient of the whole array
// that no longer fits in cache, where the plan steps one cache-sized range at a time; below it
// the plan's passes (write, bucket and read back a record of every block) cost more than they
// save. The limits were measured with the kernel A/B tool on one machine (a 2-core EPYC:
// 512 KiB L2, 32 MiB L3), at 1 and 2 threads, float32, with the app's DLRM shapes and the pair
// model; the numbers are in docs/benchmarks.md ("CPU kernel A/B history"). Other caches or
// core counts may move them: measure there before changing them (benchmarks/results/probes/
// names the tool's last revision, which builds the kernels of two revisions side by side).
//   1 thread: up to 12 MiB (the fused steps lost from 16 MB on).
//   2 threads: up to 4 MiB (one thread zeroes and scatters, both share the fused step; taken
//     further the direct scatter was no faster than the plan, and its fused step slower).
//   3 threads or more: always the plan. Not measured against the direct scatter, which runs on
//     one thread while the plan's phases use them all.
constexpr int64_t kDirectMaxBytes = int64_t(12) << 20;
constexpr int64_t kPageBytes = 4096;
constexpr int64_t kDirectMaxBytesTwoThreads = int64_t(4) << 20;
// acc_bytes bytes each, at the current thread count (also exported, for the tests).
bool use_direct_scatter(int64_t weights_numel, int64_t acc_bytes) {
  const int64_t bytes = weights_numel * acc_bytes;
  if (at::get_num_threads() == 1 || at::in_parallel_region()) return bytes <= kDirectMaxBytes;
  return at::get_num_threads() == 2 && bytes <= kDirectMaxBytesTwoThreads;
}

// fn(lo, hi) over [0, n) in ranges on the pool's threads, for an elementwise pass: its result
// does not depend on how [0, n) is split.
template <typename F>
void elementwise_ranges(int64_t n, const F& fn) {
  parallel_for_dynamic(n, dynamic_chunk(n, int64_t(1) << 16), fn);
}

// Arrays beyond this go through the backward scatter's window (see ScatterWindow), measured
// with this limit at one thread (docs/benchmarks.md).
constexpr int64_t kScatterWindowMinBytes = int64_t(512) << 10;

// Whether the direct scatter goes through a ScatterWindow (also exported, for the tests): for
// an array beyond kScatterWindowMinBytes, or for grad_output rows longer than a page. A
// feature's slices of successive rows then lie on different pages, where the hardware's
// stride prefetcher does not follow, and the window's prefetches fetch them instead.
bool direct_scatter_windowed(int64_t weights_numel, int64_t acc_bytes, int64_t row_bytes) {
  return weights_numel * acc_bytes > kScatterWindowMinBytes || row_bytes > kPageBytes;
}

// The blocks waiting to be added, in order: a block is added once kScatterWindow more have
// been hashed (and prefetched) after it. kZ > 0: every block holds kZ elements.
template <typename acc_t, int64_t kZ>
class ScatterWindow {
 public:
  void push(acc_t* dst, const acc_t* src, int64_t len, acc_t scale) {
    prefetch_block<1>(dst, len);
    prefetch_block(src, len);
    ring_[tail_ & kMask] = Pending{dst, src, scale, static_cast<int32_t>(len)};
    if (++tail_ - head_ > kScatterWindow) pop();
  }
  void drain() {
    while (head_ != tail_) pop();
  }

 private:
  static constexpr int64_t kScatterWindow = 32;
  static constexpr int64_t kMask = 63;  // ring of 64 >= kScatterWindow + 1 entries
  struct Pending {
    acc_t* dst;
    const acc_t* src;
    acc_t scale;
    int32_t len;
  };
  void pop() {
    const Pending& e = ring_[head_++ & kMask];
    if constexpr (kZ > 0) {
      add_scaled_fixed<kZ>(e.dst, e.src, e.scale);
    } else {
      add_scaled(e.dst, e.src, e.len, e.scale);
    }
  }
  Pending ring_[kMask + 1];
  int64_t head_ = 0, tail_ = 0;
};

// kWindowed: through a ScatterWindow (arrays beyond 512 KiB), or each block added as it is hashed.
// kZ > 0: every feature's dim is a multiple of Z = kZ, so every block holds kZ elements.
template <typename acc_t, bool kWindowed, int64_t kZ>
void direct_scatter_impl(const BackwardInputs& in, int64_t hash_mode, const std::vector<int64_t>& hash_params,
                         acc_t* __restrict__ buf) {
  const Layout& L = in.L;
  const int64_t B = L.B, Z = L.Z, ldg = in.ldg;
  const acc_t* go = in.grad_output.data_ptr<acc_t>();
  const acc_t* psw = in.psw.defined() ? in.psw.data_ptr<acc_t>() : nullptr;
  ScatterWindow<acc_t, kZ> window;
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_direct_scatter", [&] {
    const index_t* offs = in.offsets.data_ptr<index_t>();
    const index_t* vals = in.values.data_ptr<index_t>();
    dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
      for (int64_t t = 0; t < L.T; ++t) {
        const Feature& f = L.feats[t];
        acc_t* wbuf = buf + f.w_offset;
        for (int64_t b = 0; b < B; ++b) {
          const int64_t bag = t * B + b;
          const int64_t s = offs[bag], e = offs[bag + 1];
          const acc_t* grow = go + b * ldg + f.out_offset;
          const acc_t len = static_cast<acc_t>(e - s);
          for (int64_t p = s; p < e; ++p) {
            const acc_t scale = value_scale(psw, p, f, len);
            hash.blocks(f.key(static_cast<int64_t>(vals[p])), f, [&](int64_t blk, uint64_t start) {
              const int64_t n = kZ > 0 ? kZ : std::min(Z, f.dim - blk * Z);
              if constexpr (kWindowed) {
                window.push(wbuf + start, grow + blk * Z, n, scale);
              } else if constexpr (kZ > 0) {
                add_scaled_fixed<kZ>(wbuf + start, grow + blk * Z, scale);
              } else {
                add_scaled(wbuf + start, grow + blk * Z, n, scale);
              }
            });
          }
        }
      }
    });
  });
  window.drain();
}

template <typename acc_t>
void direct_scatter(const BackwardInputs& in, int64_t weights_numel, int64_t hash_mode,
                    const std::vector<int64_t>& hash_params, acc_t* buf) {
  const bool windowed = direct_scatter_windowed(weights_numel, sizeof(acc_t),
                                                in.ldg * static_cast<int64_t>(sizeof(acc_t)));
  auto run = [&](auto z_tag) {
    constexpr int64_t kZ = decltype(z_tag)::value;
    if (windowed) {
      direct_scatter_impl<acc_t, true, kZ>(in, hash_mode, hash_params, buf);
    } else {
      direct_scatter_impl<acc_t, false, kZ>(in, hash_mode, hash_params, buf);
    }
  };
  const int64_t Z = in.L.Z;
  const bool whole_blocks = std::all_of(in.L.feats.begin(), in.L.feats.end(),
                                        [&](const Feature& f) { return f.dim % Z == 0; });
  with_block_length<std::is_same_v<acc_t, float>>(Z, whole_blocks, run);
}

// The whole dense gradient gw[0, M), bitwise the same on any number of threads.
template <typename acc_t>
void scatter_dense(const BackwardInputs& in, int64_t M, int64_t hash_mode,
                   const std::vector<int64_t>& hash_params, acc_t* gw) {
  if (use_direct_scatter(M, sizeof(acc_t))) {
    std::fill(gw, gw + M, acc_t(0));
    direct_scatter<acc_t>(in, M, hash_mode, hash_params, gw);
    return;
  }
  with_plan<acc_t>(in, M, hash_mode, hash_params, [&](const Plan<acc_t>& plan) {
    const acc_t* go = in.grad_output.data_ptr<acc_t>();
    parallel_for_dynamic(plan.R, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t lo = r * plan.rs, hi = std::min(lo + plan.rs, M);
        std::fill(gw + lo, gw + hi, acc_t(0));
        accumulate_bucket(plan, r, lo, hi, go, gw + lo);
      }
    });
  });
}

}  // namespace

namespace exported {
bool use_direct_scatter(int64_t weights_numel, int64_t acc_bytes) {
  return ::robe::use_direct_scatter(weights_numel, acc_bytes);
}
bool direct_scatter_windowed(int64_t weights_numel, int64_t acc_bytes, int64_t row_bytes) {
  return ::robe::direct_scatter_windowed(weights_numel, acc_bytes, row_bytes);
}
}  // namespace exported

// ---------------------------------------------------------------------------------------
// backward_dense
// ---------------------------------------------------------------------------------------

at::Tensor backward_dense(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& values,
                          const at::Tensor& offsets, const std::optional<at::Tensor>& psw,
                          const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                          const std::vector<int64_t>& hash_params) {
  const at::ScalarType wst = checked_weights_dtype(weights);
  const at::ScalarType acc_st = acc_type_of(wst);
  BackwardInputs in = prepare_backward(grad_output, weights, values, offsets, psw, table_meta, block_size,
                                       hash_mode, hash_params, acc_st);
  const int64_t M = weights.numel();
  at::Tensor grad = at::empty({M}, weights.options().dtype(acc_st));
  AT_DISPATCH_FLOATING_TYPES(acc_st, "robe_backward_dense", [&] {
    scatter_dense<scalar_t>(in, M, hash_mode, hash_params, grad.data_ptr<scalar_t>());
  });
  return wst == acc_st ? grad : grad.to(wst);
}

// ---------------------------------------------------------------------------------------
// backward_fused_: scatter + optimizer step, one cache-sized weight range at a time
// ---------------------------------------------------------------------------------------

void backward_fused_(const at::Tensor& grad_output, at::Tensor weights, at::Tensor state1, at::Tensor state2,
                     const at::Tensor& values, const at::Tensor& offsets, const std::optional<at::Tensor>& psw,
                     const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                     const std::vector<int64_t>& hash_params, int64_t optimizer,
                     const std::vector<double>& hparams, int64_t step) {
  const at::ScalarType wst = checked_weights_dtype(weights);
  const at::ScalarType acc_st = acc_type_of(wst);
  if (optimizer != OPT_SGD && optimizer != OPT_ADAGRAD && optimizer != OPT_ADAM &&
      optimizer != OPT_ROWWISE_ADAGRAD) {
    fail(cat("robe: unknown fused optimizer ", optimizer,
             "; optimizer must be 0 (sgd), 1 (adagrad), 2 (adam) or 3 (rowwise_adagrad)"));
  }
  if (hparams.size() != 5) fail(cat("robe: hparams must hold 5 floats (lr, eps, beta1, beta2, weight_decay), got ", hparams.size()));
  if (!weights.is_contiguous()) fail("robe: the fused backward updates weights in place; they must be contiguous");
  // the layout first (block_size included, which the row-wise state's size divides by), as
  // the Python implementations do; it writes nothing
  BackwardInputs in = prepare_backward(grad_output, weights, values, offsets, psw, table_meta, block_size,
                                       hash_mode, hash_params, acc_st);
  const int64_t M = weights.numel();
  const int64_t rows = (M + block_size - 1) / block_size;  // row-wise Adagrad's state entries
  auto check_state = [&](const at::Tensor& s, const char* name, int64_t numel) {
    check_cpu(s, name);
    if (s.numel() != numel || s.scalar_type() != acc_st || !s.is_contiguous()) {
      fail(cat("robe: ", name, " must be a contiguous ", acc_st, " tensor of ", numel, " elements for ", wst,
               " weights of ", M, " elements, got ", s.scalar_type(), " with ", s.numel(), " elements"));
    }
  };
  if (optimizer == OPT_ADAGRAD || optimizer == OPT_ADAM) check_state(state1, "state1", M);
  if (optimizer == OPT_ADAM) check_state(state2, "state2", M);
  if (optimizer == OPT_ROWWISE_ADAGRAD) check_state(state1, "state1", rows);
  if (optimizer == OPT_ADAM && step < 1) fail(cat("robe: Adam needs step >= 1, got ", step));
  const HParams hp{hparams[0], hparams[1], hparams[2], hparams[3], hparams[4]};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, wst, "robe_backward_fused", [&] {
    using W = scalar_t;
    using T = at::opmath_type<W>;
    W* w = weights.data_ptr<W>();
    T* s1 = optimizer != OPT_SGD ? state1.data_ptr<T>() : nullptr;
    T* s2 = optimizer == OPT_ADAM ? state2.data_ptr<T>() : nullptr;
    const double bias1 = 1.0 - std::pow(hp.beta1, static_cast<double>(step));
    const double bias2_sqrt = std::sqrt(1.0 - std::pow(hp.beta2, static_cast<double>(step)));
    // the optimizer step of weights [lo, lo + n), whose gradient is in grad
    auto step_range = [&](int64_t lo, int64_t n, const T* grad) {
      if (optimizer == OPT_SGD) {
        sgd_range<W, T>(w + lo, grad, n, static_cast<T>(hp.lr), static_cast<T>(hp.wd));
      } else if (optimizer == OPT_ADAGRAD) {
        adagrad_range<W, T>(w + lo, s1 + lo, grad, n, static_cast<T>(hp.lr), static_cast<T>(hp.eps),
                            static_cast<T>(hp.wd));
      } else {
        adam_range<W, T>(w + lo, s1 + lo, s2 + lo, grad, n, static_cast<T>(hp.wd),
                      static_cast<T>(1.0 - hp.beta1), static_cast<T>(hp.beta2),
                      static_cast<T>(1.0 - hp.beta2), static_cast<T>(1.0 / bias2_sqrt),
                      static_cast<T>(hp.eps), static_cast<T>(-hp.lr / bias1));
      }
    };
    if (optimizer == OPT_ROWWISE_ADAGRAD) {
      // a row can straddle two of the plan's ranges: step the rows once the whole gradient is in
      T* grad = t_direct.get<T>(static_cast<size_t>(M));
      scatter_dense<T>(in, M, hash_mode, hash_params, grad);
      parallel_for_dynamic(rows, dynamic_chunk(rows, std::max<int64_t>(1, 16384 / block_size)),
                           [&](int64_t r0, int64_t r1) {
        rowwise_adagrad_rows<W, T>(w, s1, grad + r0 * block_size, r0, r1, block_size, M,
                                   static_cast<T>(hp.lr), static_cast<T>(hp.eps), static_cast<T>(hp.wd));
      });
      t_direct.trim();
      return;
    }
    if (use_direct_scatter(M, sizeof(T))) {
      T* grad = t_direct.get<T>(static_cast<size_t>(M));
      std::fill(grad, grad + M, T(0));
      direct_scatter<T>(in, M, hash_mode, hash_params, grad);
      elementwise_ranges(M, [&](int64_t lo, int64_t hi) { step_range(lo, hi - lo, grad + lo); });
      return;
    }
    with_plan<T>(in, M, hash_mode, hash_params, [&](const Plan<T>& plan) {
      const T* go = in.grad_output.data_ptr<T>();
      parallel_for_dynamic(plan.R, 1, [&](int64_t r0, int64_t r1) {
        std::unique_ptr<T[]> buf_mem(new T[static_cast<size_t>(plan.rs)]);
        T* buf = buf_mem.get();
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t lo = r * plan.rs, hi = std::min(lo + plan.rs, M), n = hi - lo;
          std::fill(buf, buf + n, T(0));
          accumulate_bucket(plan, r, lo, hi, go, buf);
          step_range(lo, n, buf);
        }
      });
    });
  });
}

// ---------------------------------------------------------------------------------------
// per_sample_weights_grad
// ---------------------------------------------------------------------------------------

namespace {

template <typename T, typename index_t, typename Hash>
void psw_grad_kernel(const T* __restrict__ go, const T* __restrict__ w, const index_t* __restrict__ vals,
                     const index_t* __restrict__ offs, T* __restrict__ out, int64_t ldg, const Layout& L,
                     const Hash& hash, int64_t N) {
  const int64_t B = L.B, T_ = L.T, Z = L.Z;
  const int64_t n_bags = B * T_;
  const int64_t entries_per_bag = std::max<int64_t>(1, N * std::max<int64_t>(L.max_blocks, 1) / std::max<int64_t>(n_bags, 1));
  const int64_t tile = std::clamp<int64_t>(kTileEntries / entries_per_bag, 1, 256);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, entries_per_bag * Z));
  parallel_for_dynamic(n_bags, dynamic_chunk(n_bags, grain), [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> starts;  // flat weight index of each (value, block) of the tile
    starts.reserve(4 * kTileEntries);
    for (int64_t tb0 = i0; tb0 < i1; tb0 += tile) {
      const int64_t tb1 = std::min(i1, tb0 + tile);
      starts.clear();
      for (int64_t bag = tb0; bag < tb1; ++bag) {  // pass 1: hash and prefetch
        const Feature& f = L.feats[bag / B];
        const T* wf = w + f.w_offset;
        for (int64_t p = offs[bag], e = offs[bag + 1]; p < e; ++p) {
          const uint64_t key = f.key(static_cast<int64_t>(vals[p]));
          hash.blocks(key, f, [&](int64_t blk, uint64_t start) {
            prefetch_block(wf + start, std::min(Z, f.dim - blk * Z));
            starts.push_back(f.w_offset + static_cast<int64_t>(start));
          });
        }
      }
      const int64_t* st = starts.data();
      for (int64_t bag = tb0; bag < tb1; ++bag) {  // pass 2: dot products
        const Feature& f = L.feats[bag / B];
        const int64_t s = offs[bag], e = offs[bag + 1];
        const T* __restrict__ grow = go + (bag % B) * ldg + f.out_offset;
        const T len = static_cast<T>(e - s);
        const int64_t D = f.dim;
        for (int64_t p = s; p < e; ++p) {
          T dot = T(0);
          for (int64_t blk = 0; blk < f.nblocks; ++blk) {
            const T* __restrict__ src = w + *st++;
            const T* __restrict__ g = grow + blk * Z;
            const int64_t n = std::min(Z, D - blk * Z);
            T part = T(0);
#pragma omp simd reduction(+ : part)
            for (int64_t j = 0; j < n; ++j) part += src[j] * g[j];
            dot += part;
          }
          out[p] = f.mean ? dot / len : dot;
        }
      }
    }
  });
}

}  // namespace

at::Tensor per_sample_weights_grad(const at::Tensor& grad_output, const at::Tensor& weights,
                                   const at::Tensor& values, const at::Tensor& offsets,
                                   const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                                   const std::vector<int64_t>& hash_params) {
  const at::ScalarType wst = checked_weights_dtype(weights);
  const at::ScalarType acc_st = acc_type_of(wst);
  BackwardInputs in = prepare_backward(grad_output, weights, values, offsets, std::nullopt, table_meta,
                                       block_size, hash_mode, hash_params, acc_st);
  const at::Tensor w = weights.to(acc_st).contiguous();
  at::Tensor out = at::empty({in.N}, weights.options().dtype(acc_st));
  AT_DISPATCH_INDEX_TYPES(in.values.scalar_type(), "robe_psw_grad_index", [&] {
    AT_DISPATCH_FLOATING_TYPES(acc_st, "robe_psw_grad", [&] {
      dispatch_hash(hash_mode, hash_params, [&](const auto& hash) {
        psw_grad_kernel<scalar_t, index_t>(in.grad_output.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                                           in.values.data_ptr<index_t>(), in.offsets.data_ptr<index_t>(),
                                           out.data_ptr<scalar_t>(), in.ldg, in.L, hash, in.N);
      });
    });
  });
  return wst == acc_st ? out : out.to(wst);
}

}  // namespace robe
