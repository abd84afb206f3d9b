// torch.ops.<ext>.forward: the pooled forward (forward.h's kernel, FULL mode only).

#include "forward.h"
#include "ops.h"

namespace robe {

at::Tensor forward(const at::Tensor& weights, const at::Tensor& values, const at::Tensor& offsets,
                   const std::optional<at::Tensor>& psw, const at::Tensor& table_meta, int64_t output_dim,
                   int64_t block_size, int64_t hash_mode, const std::vector<int64_t>& hash_params,
                   int64_t bounds_check) {
  return forward_impl<ForwardMode::FULL>(weights, values, offsets, psw, table_meta, output_dim,
                                         block_size, hash_mode, hash_params, bounds_check);
}

namespace exported {
bool forward_prefetches(int64_t weights_bytes) { return ::robe::forward_prefetches(weights_bytes); }
}  // namespace exported

}  // namespace robe
