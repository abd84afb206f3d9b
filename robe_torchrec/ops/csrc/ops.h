// The operators of the CPU kernels, registered by register.cpp under the extension's own
// namespace (torch.ops.<extension name>.<name>); defined in forward.cpp and backward.cpp.
// Hidden: two builds loaded into one process (the kernel A/B benchmark) keep their own.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#pragma GCC visibility push(hidden)
namespace robe {

// forward.cpp
at::Tensor forward(const at::Tensor& weights, const at::Tensor& values, const at::Tensor& offsets,
                   const std::optional<at::Tensor>& psw, const at::Tensor& table_meta, int64_t output_dim,
                   int64_t block_size, int64_t hash_mode, const std::vector<int64_t>& hash_params,
                   int64_t bounds_check);

// backward.cpp
at::Tensor backward_dense(const at::Tensor& grad_output, const at::Tensor& weights, const at::Tensor& values,
                          const at::Tensor& offsets, const std::optional<at::Tensor>& psw,
                          const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                          const std::vector<int64_t>& hash_params);
void backward_fused_(const at::Tensor& grad_output, at::Tensor weights, at::Tensor state1, at::Tensor state2,
                     const at::Tensor& values, const at::Tensor& offsets, const std::optional<at::Tensor>& psw,
                     const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                     const std::vector<int64_t>& hash_params, int64_t optimizer,
                     const std::vector<double>& hparams, int64_t step);
at::Tensor per_sample_weights_grad(const at::Tensor& grad_output, const at::Tensor& weights,
                                   const at::Tensor& values, const at::Tensor& offsets,
                                   const at::Tensor& table_meta, int64_t block_size, int64_t hash_mode,
                                   const std::vector<int64_t>& hash_params);

// The kernels' strategy choices, exported for the tests.
namespace exported {
bool forward_prefetches(int64_t weights_bytes);                                          // forward.cpp
bool use_direct_scatter(int64_t weights_numel, int64_t acc_bytes);                       // backward.cpp
bool direct_scatter_windowed(int64_t weights_numel, int64_t acc_bytes, int64_t row_bytes);  // backward.cpp
}  // namespace exported

}  // namespace robe
#pragma GCC visibility pop
