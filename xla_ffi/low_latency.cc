// FFI targets of the low-latency mode (SPEC §4), platform "CUDA". Each split phase is one target; the fused public
// ops call send then receive, joined by the `token` array (epoch of the op), which is also the data dependency XLA
// sees between the two halves.
//   jax_ep_ll_dispatch_send_v1   x [T, H] bf16, topk_idx [T, K] s32               -> token [2] s32
//   jax_ep_ll_dispatch_recv_v1   token [2]  -> recv_x [L, R*T_max, H] (f8e4m3fn | bf16),
//                                              recv_x_scales [L, R*T_max, S] f32 (S = 0 for bf16),
//                                              recv_count [L], src_info [L, R*T_max], layout_range [L, R] (s32)
//   jax_ep_ll_combine_send_v1    expert_out [L, R*T_max, H] bf16, src_info, layout_range -> token [2] s32
//   jax_ep_ll_combine_recv_v1    token [2], topk_idx [T, K] s32, topk_weights [T, K] f32 -> y [T, H] bf16
// Attributes: group_id (i64), num_experts, hidden, num_topk, max_tokens_per_rank (i32), timeout_ns (i64),
// ll_offset, ll_bytes (i64: where the runtime put the low-latency region of the staging buffer), and use_fp8 (i32)
// for the dispatch halves.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "checks.h"
#include "errors.h"
#include "jax_ep/api.h"
#include "jax_ep/constants.h"
#include "jax_ep/low_latency.h"
#include "jax_ep/peer_group.h"
#include "registry.h"
#include "types.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using ffi_util::ensure_device;
using ffi_util::Guarded;
using ffi_util::Invalid;
using ffi_util::ToFfi;
using namespace ffi_types;  // NOLINT

struct LowLatencyAttrs {
  int64_t group_id;
  int32_t num_experts, hidden, num_topk, max_tokens_per_rank;
  int64_t timeout_ns, ll_offset, ll_bytes;
};

// Group lookup + config and region checks shared by the four targets.
ffi::Error make_ll_ctx(const char* target, int32_t ordinal, const LowLatencyAttrs& a, LowLatencyCtx* c) {
  GroupDeviceView v;
  if (Status st = find_group_device(a.group_id, ordinal, &v); !st.ok()) return ToFfi(target, st);
  const int R = v.num_ranks;
  JAX_EP_CHECK(target, a.num_experts > 0 && a.num_experts % R == 0 && a.num_experts <= kMaxLowLatencyExperts,
               "num_experts (" + std::to_string(a.num_experts) + ") must be a positive multiple of the group size (" +
                   std::to_string(R) + ") and <= " + std::to_string(kMaxLowLatencyExperts) + " in low-latency mode");
  JAX_EP_CHECK(target, a.hidden > 0 && a.hidden % 8 == 0, "hidden must be a positive multiple of 8");
  JAX_EP_CHECK(target, a.max_tokens_per_rank > 0, "max_tokens_per_rank must be positive");
  JAX_EP_CHECK(target, a.num_topk >= 1 && a.num_topk <= kMaxTopk,
               "num_topk must be in [1, " + std::to_string(kMaxTopk) + "]");
  JAX_EP_CHECK(target, a.ll_bytes > kLowLatencyScratchBytes,
               "the runtime has no low-latency buffers for this config (EPConfig.low_latency_buffers)");
  JAX_EP_CHECK(target, a.ll_offset >= kSignalHeaderBytes && a.ll_offset % kAlign == 0 &&
                           a.ll_offset + a.ll_bytes <= v.buffer_bytes,
               "low-latency region [" + std::to_string(a.ll_offset) + ", +" + std::to_string(a.ll_bytes) +
                   ") does not fit the group's " + std::to_string(v.buffer_bytes) + "-byte staging buffer");
  const int64_t half_bytes = (a.ll_bytes - kLowLatencyScratchBytes) / 2 / kAlign * kAlign;
  const LowLatencyLayout ll = make_low_latency_layout(a.hidden, a.max_tokens_per_rank, R, a.num_experts,
                                                      a.ll_offset, half_bytes);
  JAX_EP_CHECK(target, ll.half_needed <= half_bytes,
               "this config needs " + std::to_string(ll.half_needed) + " bytes per low-latency half but the runtime "
                   "has " + std::to_string(half_bytes) + " (pass this config to jax_ep.initialize)");
  c->g = GroupCtx{};
  c->g.peers = v.peers;
  c->g.rank = v.rank;
  c->g.num_ranks = R;
  c->g.timeout_ns = static_cast<uint64_t>(a.timeout_ns > 0 ? a.timeout_ns : 1);
  c->ll = ll;
  c->num_experts = a.num_experts;
  c->num_local = a.num_experts / R;
  c->hidden = a.hidden;
  c->max_tokens = a.max_tokens_per_rank;
  c->sm_count = v.sm_count;
  return ffi::Error::Success();
}

// Runs a handler body with the call's context (group lookup and config checks first), exceptions guarded.
template <typename Body>
ffi::Error WithContext(const char* target, int32_t ordinal, const LowLatencyAttrs& a, Body&& body) {
  return Guarded(target, [&]() -> ffi::Error {
    LowLatencyCtx c{};
    if (auto e = make_ll_ctx(target, ordinal, a, &c); !e.success()) return e;
    return body(c);
  });
}

// Launches on the handler's device (kernel launches go to XLA's stream of that device).
template <typename Params>
ffi::Error LaunchOn(const char* target, int32_t ordinal, const Params& p, cudaStream_t stream,
                    Status (*launch)(const Params&, cudaStream_t)) {
  if (Status st = ensure_device(ordinal); !st.ok()) return ToFfi(target, st);
  return ToFfi(target, launch(p, stream));
}

ffi::Error CheckToken(const char* target, const S32Vec& token) {
  JAX_EP_CHECK_SHAPE(target, "token", token, 2);
  return ffi::Error::Success();
}

ffi::Error CheckRouting(const char* target, const LowLatencyAttrs& a, const S32Mat& topk_idx, int64_t T) {
  JAX_EP_CHECK(target, T <= a.max_tokens_per_rank,
               "T=" + std::to_string(T) + " exceeds max_tokens_per_rank=" + std::to_string(a.max_tokens_per_rank));
  JAX_EP_CHECK_SHAPE(target, "topk_idx", topk_idx, T, a.num_topk);
  return ffi::Error::Success();
}

// ---- dispatch send ----------------------------------------------------------------------------------------------
constexpr const char* kDispatchSend = "jax_ep_ll_dispatch_send_v1";

ffi::Error DispatchSend(cudaStream_t stream, int32_t ordinal, AnyBuf x, S32Mat topk_idx, ffi::Result<S32Vec> token,
                        int64_t group_id, int32_t num_experts, int32_t hidden, int32_t num_topk,
                        int32_t max_tokens_per_rank, int64_t timeout_ns, int64_t ll_offset, int64_t ll_bytes,
                        int32_t use_fp8) {
  const LowLatencyAttrs a{group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns, ll_offset,
                          ll_bytes};
  return WithContext(kDispatchSend, ordinal, a, [&](const LowLatencyCtx& c) -> ffi::Error {
    JAX_EP_CHECK(kDispatchSend, x.element_type() == ffi::DataType::BF16, "x must be bfloat16");
    const auto xd = x.dimensions();
    JAX_EP_CHECK(kDispatchSend, xd.size() == 2 && xd[1] == hidden,
                 "x must be [T, " + std::to_string(hidden) + "], got " + ffi_util::shape_str(xd));
    const int64_t T = xd[0];
    if (auto e = CheckRouting(kDispatchSend, a, topk_idx, T); !e.success()) return e;
    if (auto e = CheckToken(kDispatchSend, *token); !e.success()) return e;
    JAX_EP_CHECK(kDispatchSend, !use_fp8 || hidden % kFp8Block == 0, "fp8 dispatch needs hidden % 128 == 0");

    LowLatencyDispatchSendParams p{};
    p.c = c;
    p.x = x.untyped_data();
    p.topk_idx = topk_idx.typed_data();
    p.token = token->typed_data();
    p.num_tokens = static_cast<int32_t>(T);
    p.num_topk = num_topk;
    p.use_fp8 = use_fp8 != 0;
    return LaunchOn(kDispatchSend, ordinal, p, stream, launch_low_latency_dispatch_send);
  });
}

// ---- dispatch receive -------------------------------------------------------------------------------------------
constexpr const char* kDispatchRecv = "jax_ep_ll_dispatch_recv_v1";

ffi::Error DispatchRecv(cudaStream_t stream, int32_t ordinal, S32Vec token, ffi::Result<AnyBuf> recv_x,
                        ffi::Result<F32Cube> recv_x_scales, ffi::Result<S32Vec> recv_count,
                        ffi::Result<S32Mat> src_info, ffi::Result<S32Mat> layout_range, int64_t group_id,
                        int32_t num_experts, int32_t hidden, int32_t num_topk, int32_t max_tokens_per_rank,
                        int64_t timeout_ns, int64_t ll_offset, int64_t ll_bytes, int32_t use_fp8) {
  const LowLatencyAttrs a{group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns, ll_offset,
                          ll_bytes};
  return WithContext(kDispatchRecv, ordinal, a, [&](const LowLatencyCtx& c) -> ffi::Error {
    if (auto e = CheckToken(kDispatchRecv, token); !e.success()) return e;
    const int64_t L = c.num_local, R = c.g.num_ranks, rows = R * max_tokens_per_rank;
    const int64_t S = use_fp8 ? hidden / kFp8Block : 0;
    JAX_EP_CHECK(kDispatchRecv, !use_fp8 || hidden % kFp8Block == 0, "fp8 dispatch needs hidden % 128 == 0");
    JAX_EP_CHECK(kDispatchRecv,
                 recv_x->element_type() == (use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16),
                 "recv_x must be float8_e4m3fn with use_fp8, else bfloat16");
    JAX_EP_CHECK_SHAPE(kDispatchRecv, "recv_x", (*recv_x), L, rows, hidden);
    JAX_EP_CHECK_SHAPE(kDispatchRecv, "recv_x_scales", (*recv_x_scales), L, rows, S);
    JAX_EP_CHECK_SHAPE(kDispatchRecv, "recv_count", (*recv_count), L);
    JAX_EP_CHECK_SHAPE(kDispatchRecv, "src_info", (*src_info), L, rows);
    JAX_EP_CHECK_SHAPE(kDispatchRecv, "layout_range", (*layout_range), L, R);

    LowLatencyDispatchRecvParams p{};
    p.c = c;
    p.token = token.typed_data();
    p.recv_x = recv_x->untyped_data();
    p.recv_x_scales = use_fp8 ? recv_x_scales->typed_data() : nullptr;
    p.recv_count = recv_count->typed_data();
    p.src_info = src_info->typed_data();
    p.layout_range = layout_range->typed_data();
    p.use_fp8 = use_fp8 != 0;
    return LaunchOn(kDispatchRecv, ordinal, p, stream, launch_low_latency_dispatch_recv);
  });
}

// ---- combine send -----------------------------------------------------------------------------------------------
constexpr const char* kCombineSend = "jax_ep_ll_combine_send_v1";

ffi::Error CombineSend(cudaStream_t stream, int32_t ordinal, AnyBuf expert_out, S32Mat src_info, S32Mat layout_range,
                       ffi::Result<S32Vec> token, int64_t group_id, int32_t num_experts, int32_t hidden,
                       int32_t num_topk, int32_t max_tokens_per_rank, int64_t timeout_ns, int64_t ll_offset,
                       int64_t ll_bytes) {
  const LowLatencyAttrs a{group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns, ll_offset,
                          ll_bytes};
  return WithContext(kCombineSend, ordinal, a, [&](const LowLatencyCtx& c) -> ffi::Error {
    const int64_t L = c.num_local, R = c.g.num_ranks, rows = R * max_tokens_per_rank;
    JAX_EP_CHECK(kCombineSend, expert_out.element_type() == ffi::DataType::BF16, "expert_out must be bfloat16");
    JAX_EP_CHECK_SHAPE(kCombineSend, "expert_out", expert_out, L, rows, hidden);
    JAX_EP_CHECK_SHAPE(kCombineSend, "src_info", src_info, L, rows);
    JAX_EP_CHECK_SHAPE(kCombineSend, "layout_range", layout_range, L, R);
    if (auto e = CheckToken(kCombineSend, *token); !e.success()) return e;

    LowLatencyCombineSendParams p{};
    p.c = c;
    p.expert_out = expert_out.untyped_data();
    p.src_info = src_info.typed_data();
    p.layout_range = layout_range.typed_data();
    p.token = token->typed_data();
    return LaunchOn(kCombineSend, ordinal, p, stream, launch_low_latency_combine_send);
  });
}

// ---- combine receive --------------------------------------------------------------------------------------------
constexpr const char* kCombineRecv = "jax_ep_ll_combine_recv_v1";

ffi::Error CombineRecv(cudaStream_t stream, int32_t ordinal, S32Vec token, S32Mat topk_idx, F32Mat topk_weights,
                       ffi::Result<AnyBuf> y, int64_t group_id, int32_t num_experts, int32_t hidden,
                       int32_t num_topk, int32_t max_tokens_per_rank, int64_t timeout_ns, int64_t ll_offset,
                       int64_t ll_bytes) {
  const LowLatencyAttrs a{group_id, num_experts, hidden, num_topk, max_tokens_per_rank, timeout_ns, ll_offset,
                          ll_bytes};
  return WithContext(kCombineRecv, ordinal, a, [&](const LowLatencyCtx& c) -> ffi::Error {
    if (auto e = CheckToken(kCombineRecv, token); !e.success()) return e;
    const int64_t T = topk_idx.dimensions()[0];
    if (auto e = CheckRouting(kCombineRecv, a, topk_idx, T); !e.success()) return e;
    JAX_EP_CHECK_SHAPE(kCombineRecv, "topk_weights", topk_weights, T, num_topk);
    JAX_EP_CHECK(kCombineRecv, y->element_type() == ffi::DataType::BF16, "y must be bfloat16");
    JAX_EP_CHECK_SHAPE(kCombineRecv, "y", (*y), T, hidden);

    LowLatencyCombineRecvParams p{};
    p.c = c;
    p.token = token.typed_data();
    p.topk_idx = topk_idx.typed_data();
    p.topk_weights = topk_weights.typed_data();
    p.y = y->untyped_data();
    p.num_tokens = static_cast<int32_t>(T);
    p.num_topk = num_topk;
    return LaunchOn(kCombineRecv, ordinal, p, stream, launch_low_latency_combine_recv);
  });
}

}  // namespace
}  // namespace jax_ep

namespace ffi = ::xla::ffi;
using namespace jax_ep::ffi_types;  // NOLINT

#define JAX_EP_LL_ATTRS                               \
  .Attr<int64_t>("group_id")                          \
      .Attr<int32_t>("num_experts")                   \
      .Attr<int32_t>("hidden")                        \
      .Attr<int32_t>("num_topk")                      \
      .Attr<int32_t>("max_tokens_per_rank")           \
      .Attr<int64_t>("timeout_ns")                    \
      .Attr<int64_t>("ll_offset")                     \
      .Attr<int64_t>("ll_bytes")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchSendCudaV1, jax_ep::DispatchSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<AnyBuf>()   // x [T, H] bf16
                                  .Arg<S32Mat>()   // topk_idx [T, K]
                                  .Ret<S32Vec>()   // token [2]
                                  JAX_EP_LL_ATTRS
                                  .Attr<int32_t>("use_fp8"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchRecvCudaV1, jax_ep::DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<S32Vec>()   // token [2]
                                  .Ret<AnyBuf>()   // recv_x [L, R*T_max, H]
                                  .Ret<F32Cube>()  // recv_x_scales [L, R*T_max, S]
                                  .Ret<S32Vec>()   // recv_count [L]
                                  .Ret<S32Mat>()   // src_info [L, R*T_max]
                                  .Ret<S32Mat>()   // layout_range [L, R]
                                  JAX_EP_LL_ATTRS
                                  .Attr<int32_t>("use_fp8"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyCombineSendCudaV1, jax_ep::CombineSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<AnyBuf>()   // expert_out [L, R*T_max, H] bf16
                                  .Arg<S32Mat>()   // src_info [L, R*T_max]
                                  .Arg<S32Mat>()   // layout_range [L, R]
                                  .Ret<S32Vec>()   // token [2]
                                  JAX_EP_LL_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyCombineRecvCudaV1, jax_ep::CombineRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<S32Vec>()   // token [2]
                                  .Arg<S32Mat>()   // topk_idx [T, K]
                                  .Arg<F32Mat>()   // topk_weights [T, K]
                                  .Ret<AnyBuf>()   // y [T, H] bf16
                                  JAX_EP_LL_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});
