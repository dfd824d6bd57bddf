// FFI target jax_ep_layout_v1 (platforms "cpu" and "CUDA", stateless): the routing layout of SPEC §3.
//
//   operand  topk_idx              [T, K] s32
//   attrs    num_experts (i32), num_ranks (i32)
//   results  num_tokens_per_rank   [R] s32
//            num_tokens_per_expert [E] s32
//            is_token_in_rank      [T, R] pred
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "errors.h"
#include "jax_ep/api.h"
#include "jax_ep/constants.h"
#include "registry.h"
#include "types.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using ffi_util::Guarded;
using ffi_util::Invalid;
using ffi_util::ToFfi;
using namespace ffi_types;  // NOLINT

constexpr const char* kTarget = targets::kLayout;

// Decodes and validates; shared by both platforms.
ffi::ErrorOr<layout::Params> MakeLayoutParams(S32Mat& topk_idx, ffi::Result<S32Vec>& ntr,
                                            ffi::Result<S32Vec>& nte,
                                            ffi::Result<PredMat>& itr, int32_t num_experts,
                                            int32_t num_ranks, int max_experts) {
  const auto dims = topk_idx.dimensions();
  const int64_t T = dims[0], K = dims[1];
  if (num_ranks <= 0 || num_ranks > kMaxGroupRanks)
    return ffi::Unexpected(Invalid(kTarget, "num_ranks must be in [1, " + std::to_string(kMaxGroupRanks) +
                                                "], got " + std::to_string(num_ranks)));
  if (num_experts <= 0 || num_experts % num_ranks != 0 || num_experts > max_experts)
    return ffi::Unexpected(Invalid(kTarget, "num_experts must be a positive multiple of num_ranks (" +
                                                std::to_string(num_ranks) + ") and <= " + std::to_string(max_experts) +
                                                ", got " + std::to_string(num_experts)));
  if (K < 1 || K > kMaxTopk)
    return ffi::Unexpected(Invalid(kTarget, "topk_idx must be [T, K] with 1 <= K <= " + std::to_string(kMaxTopk) +
                                                ", got K=" + std::to_string(K)));
  if (T > INT32_MAX / kMaxGroupRanks) return ffi::Unexpected(Invalid(kTarget, "too many tokens"));
  if (ntr->dimensions()[0] != num_ranks)
    return ffi::Unexpected(Invalid(kTarget, "num_tokens_per_rank must have shape [num_ranks]"));
  if (nte->dimensions()[0] != num_experts)
    return ffi::Unexpected(Invalid(kTarget, "num_tokens_per_expert must have shape [num_experts]"));
  if (itr->dimensions()[0] != T || itr->dimensions()[1] != num_ranks)
    return ffi::Unexpected(Invalid(kTarget, "is_token_in_rank must have shape [T, num_ranks]"));
  layout::Params p{};
  p.topk_idx = topk_idx.typed_data();
  p.num_tokens_per_rank = ntr->typed_data();
  p.num_tokens_per_expert = nte->typed_data();
  p.is_token_in_rank = itr->typed_data();
  p.send_pos = nullptr;
  p.num_tokens = static_cast<int32_t>(T);
  p.num_topk = static_cast<int32_t>(K);
  p.num_experts = num_experts;
  p.num_ranks = num_ranks;
  return p;
}

ffi::Error LayoutCpu(S32Mat topk_idx, ffi::Result<S32Vec> ntr,
                     ffi::Result<S32Vec> nte, ffi::Result<PredMat> itr,
                     int32_t num_experts, int32_t num_ranks) {
  return Guarded(kTarget, [&]() -> ffi::Error {
    auto p = MakeLayoutParams(topk_idx, ntr, nte, itr, num_experts, num_ranks, INT32_MAX);
    if (p.has_error()) return p.error();
    return ToFfi(kTarget, layout::run_host(p.value()));
  });
}

ffi::Error LayoutCuda(cudaStream_t stream, S32Mat topk_idx, ffi::Result<S32Vec> ntr,
                      ffi::Result<S32Vec> nte, ffi::Result<PredMat> itr,
                      int32_t num_experts, int32_t num_ranks) {
  return Guarded(kTarget, [&]() -> ffi::Error {
    auto p = MakeLayoutParams(topk_idx, ntr, nte, itr, num_experts, num_ranks, kMaxLayoutExperts);
    if (p.has_error()) return p.error();
    return ToFfi(kTarget, layout::launch(p.value(), stream));
  });
}

}  // namespace
}  // namespace jax_ep

namespace ffi = ::xla::ffi;
using namespace jax_ep::ffi_types;  // NOLINT

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLayoutCpuV1, jax_ep::LayoutCpu,
                              ffi::Ffi::Bind()
                                  .Arg<S32Mat>()           // topk_idx [T, K]
                                  .Ret<S32Vec>()           // num_tokens_per_rank [R]
                                  .Ret<S32Vec>()           // num_tokens_per_expert [E]
                                  .Ret<PredMat>()          // is_token_in_rank [T, R]
                                  .Attr<int32_t>("num_experts")              // E
                                  .Attr<int32_t>("num_ranks"));              // R

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLayoutCudaV1, jax_ep::LayoutCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
                                  .Arg<S32Mat>()           // topk_idx [T, K]
                                  .Ret<S32Vec>()           // num_tokens_per_rank [R]
                                  .Ret<S32Vec>()           // num_tokens_per_expert [E]
                                  .Ret<PredMat>()          // is_token_in_rank [T, R]
                                  .Attr<int32_t>("num_experts")              // E
                                  .Attr<int32_t>("num_ranks"),               // R
                              {ffi::Traits::kCmdBufferCompatible});
