// Registers the operators of ops.h as a library named after the extension, called as
// torch.ops.<extension name>.<function>.

#include <torch/library.h>

#include "ops.h"

namespace robe {
namespace {

bool openmp_enabled() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace robe

// TORCH_LIBRARY pastes its first argument into names, so the extension's name (a macro the
// build defines) is expanded one level up. Each build of this file registers its own
// namespace: the kernel A/B benchmark loads two builds into one process.
#define ROBE_CPU_LIBRARY(name, m) TORCH_LIBRARY(name, m)

ROBE_CPU_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &robe::forward);
  m.def("backward_dense", &robe::backward_dense);
  m.def("per_sample_weights_grad", &robe::per_sample_weights_grad);
  m.def("backward_fused_", &robe::backward_fused_);
  m.def("openmp_enabled", &robe::openmp_enabled);
  m.def("use_direct_scatter", &robe::exported::use_direct_scatter);
  m.def("direct_scatter_windowed", &robe::exported::direct_scatter_windowed);
  m.def("forward_prefetches", &robe::exported::forward_prefetches);
}
