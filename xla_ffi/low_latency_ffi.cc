// FFI targets of the low-latency mode (decode, SPEC §4), platform "CUDA", stateful bundles {instantiate, execute}.
// Every target takes the chain state [4] s32 as its LAST operand and returns the next state as its LAST result
// (Python aliases the two); the kernels read and write it on the device (protocol: cuda/include/jax_ep/low_latency_params.h).
//
//   jax_ep_low_latency_dispatch_v6        x [T, H] bf16, topk_idx [T, K] s32, state
//                                  -> recv_x [L, R*T_max, H] (f8e4m3fn | bf16), recv_x_scales [L, R*T_max, S] f32
//                                     (S = H/128 with use_fp8, else 0), recv_count [L], src_info [L, R*T_max],
//                                     layout_range [L, R], msg_token [R, M], token_rows [R, M, K] (s32; M = T_max
//                                     in per_rank mode, else 0), state
//   jax_ep_low_latency_dispatch_send_v6   x, topk_idx, state -> token [4] s32, state
//   jax_ep_low_latency_dispatch_recv_v6   token, state -> recv_x, recv_x_scales, recv_count, src_info, layout_range,
//                                msg_token, token_rows, state
//   jax_ep_low_latency_combine_v6         expert_out [L, R*T_max, H] bf16, src_info, layout_range, msg_token, token_rows,
//                                topk_idx [T, K] s32, topk_weights [T, K] f32, state -> y [T, H] bf16, state
//   jax_ep_low_latency_combine_send_v6    expert_out, src_info, layout_range, msg_token, token_rows, topk_weights, state
//                                -> token, state
//   jax_ep_low_latency_combine_recv_v6    token, topk_idx, topk_weights, state -> y, state
// msg_token / token_rows (the handle's per_rank tables) are read only in per_rank mode (LowLatencyAttrs.per_rank);
// in per_expert mode they are empty.
// The fused targets launch the send kernel and the receive kernel back to back (one handler); the split targets one
// kernel each. Attributes: LowLatencyAttrs (attrs.h). The LL region of the staging comes from the axis binding.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "attrs.h"
#include "checks.h"
#include "errors.h"
#include "jax_ep/api.h"
#include "jax_ep/constants.h"
#include "jax_ep/nvshmem_ops.h"
#include "jax_ep/signal_header.h"
#include "op_state.h"
#include "registry.h"
#include "test_hooks.h"
#include "types.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {
namespace {

namespace ffi = ::xla::ffi;
using ffi_util::ensure_device;
using ffi_util::Guarded;
using ffi_util::ToFfi;
using namespace ffi_types;  // NOLINT

// Runs a handler body with the call site resolved on this device (group, LL region, validated config).
template <typename Body>
ffi::Error WithContext(OpState* st, int32_t ordinal, Body&& body) {
  return Guarded(st->target(), [&]() -> ffi::Error {
    const Resolved* r = nullptr;
    if (auto e = st->resolve(ordinal, &r); !e.success()) return e;
    return body(r->low_latency);
  });
}

// Launches on the handler's device (kernel launches go to XLA's stream of that device).
template <typename Launch>
ffi::Error LaunchOn(const char* target, int32_t ordinal, Launch&& launch) {
  if (Status s = ensure_device(ordinal); !s.ok()) return ToFfi(target, s);
  return ToFfi(target, launch());
}

// ---- which kernels: the NVLink kernels of this module, or the NVSHMEM ones of jax_ep._jax_ep_nvshmem ----------
// (OpConfig::nvshmem: EPConfig.low_latency_over_nvshmem(R); jax_ep/nvshmem_ops.h). One launcher per kernel, both ways.
// hook: this launch is a handler call of its own (test_hooks::skip_launch counts it once), not a half of a fused op.
template <typename Params>
Status LaunchEither(const OpState& st, const Params& p, cudaStream_t s, Status (*nvlink)(const Params&, cudaStream_t),
                    const char* (*const LowLatencyNvshmemOps::*nvshmem)(const Params&, cudaStream_t), bool hook) {
  if (hook && test_hooks::skip_launch(p.c.g.rank)) return Status::Ok();
  if (!st.config().nvshmem) return nvlink(p, s);
  const LowLatencyNvshmemOps* ops = low_latency_nvshmem_ops();
  if (ops == nullptr)
    return Status::Error("the NVSHMEM low-latency kernels (allow_nvlink_for_low_latency=False or R > "
                         "num_max_nvl_peers) are those of jax_ep._jax_ep_nvshmem, installed by jax_ep.initialize "
                         "with one process per GPU and a module built with NVSHMEM's device library");
  const char* error = (ops->*nvshmem)(p, s);
  return error == nullptr ? Status::Ok() : Status::Error(error);
}

Status Launch(const OpState& st, const low_latency::DispatchSendParams& p, cudaStream_t s, bool hook = true) {
  return LaunchEither(st, p, s, &low_latency::launch_dispatch_send, &LowLatencyNvshmemOps::dispatch_send, hook);
}
Status Launch(const OpState& st, const low_latency::DispatchRecvParams& p, cudaStream_t s, bool hook = true) {
  return LaunchEither(st, p, s, &low_latency::launch_dispatch_recv, &LowLatencyNvshmemOps::dispatch_recv, hook);
}
Status Launch(const OpState& st, const low_latency::CombineSendParams& p, cudaStream_t s, bool hook = true) {
  return LaunchEither(st, p, s, &low_latency::launch_combine_send, &LowLatencyNvshmemOps::combine_send, hook);
}
Status Launch(const OpState& st, const low_latency::CombineRecvParams& p, cudaStream_t s, bool hook = true) {
  return LaunchEither(st, p, s, &low_latency::launch_combine_recv, &LowLatencyNvshmemOps::combine_recv, hook);
}
// A fused op. NVLink kernels: one launcher for both halves (low_latency::launch_dispatch / launch_combine: one kernel
// in per_expert mode); NVSHMEM kernels: the send kernel, then the receive kernel, on one stream.
template <typename Send, typename Recv>
Status LaunchFused(const OpState& st, const Send& send, const Recv& recv, cudaStream_t s,
                   Status (*nvlink)(const Send&, const Recv&, cudaStream_t)) {
  if (test_hooks::skip_launch(send.c.g.rank)) return Status::Ok();
  if (!st.config().nvshmem) return nvlink(send, recv, s);
  JAX_EP_RETURN_IF_ERROR(Launch(st, send, s, false));
  return Launch(st, recv, s, false);
}
Status Launch(const OpState& st, const low_latency::DispatchSendParams& send,
              const low_latency::DispatchRecvParams& recv, cudaStream_t s) {
  return LaunchFused(st, send, recv, s, &low_latency::launch_dispatch);
}
Status Launch(const OpState& st, const low_latency::CombineSendParams& send,
              const low_latency::CombineRecvParams& recv, cudaStream_t s) {
  return LaunchFused(st, send, recv, s, &low_latency::launch_combine);
}

// The header slot joining the two kernels of a fused op (SignalHeader::kLowLatencyFusedToken, this rank's own buffer).
int32_t* fused_token(const low_latency::Ctx& c) {
  return reinterpret_cast<int32_t*>(c.g.peers.base[c.g.rank] + SignalHeader::kLowLatencyFusedToken);
}

ffi::Error CheckWords(const char* target, const char* name, const S32Vec& buf) {
  JAX_EP_CHECK_SHAPE(target, name, buf, low_latency::kStateWords);
  return ffi::Error::Success();
}

// ---- parameter filling, one per kernel; each checks the buffers it reads or writes ----------------------------
ffi::Error FillDispatchSend(const char* target, const OpState& st, const low_latency::Ctx& c, const AnyBuf& x,
                            const S32Mat& topk_idx, low_latency::DispatchSendParams* p) {
  const OpConfig& a = st.config();
  JAX_EP_CHECK(target, x.element_type() == ffi::DataType::BF16, "x must be bfloat16");
  const auto xd = x.dimensions();
  JAX_EP_CHECK(target, xd.size() == 2 && xd[1] == a.hidden,
               "x must be [T, " + std::to_string(a.hidden) + "], got " + ffi_util::shape_str(xd));
  const int64_t T = xd[0];
  JAX_EP_CHECK(target, T <= a.max_tokens_per_rank,
               "T=" + std::to_string(T) + " exceeds max_tokens_per_rank=" + std::to_string(a.max_tokens_per_rank));
  JAX_EP_CHECK_SHAPE(target, "topk_idx", topk_idx, T, a.num_topk);
  p->c = c;
  p->x = x.untyped_data();
  p->topk_idx = topk_idx.typed_data();
  p->num_tokens = static_cast<int32_t>(T);
  p->num_topk = a.num_topk;
  p->use_fp8 = a.use_fp8;
  p->per_rank = a.per_rank;
  return ffi::Error::Success();
}

// The handle's per_rank tables: [R, T_max] and [R, T_max, K] in per_rank mode, empty ([R, 0], [R, 0, K]) else.
ffi::Error CheckTables(const char* target, const OpState& st, const low_latency::Ctx& c, const S32Mat& msg_token,
                       const S32Cube& token_rows) {
  const int64_t R = c.g.num_ranks, M = st.config().per_rank ? c.max_tokens : 0;
  JAX_EP_CHECK_SHAPE(target, "msg_token", msg_token, R, M);
  JAX_EP_CHECK_SHAPE(target, "token_rows", token_rows, R, M, st.config().num_topk);
  return ffi::Error::Success();
}

ffi::Error FillDispatchRecv(const char* target, const OpState& st, const low_latency::Ctx& c, AnyBuf& recv_x,
                            F32Cube& recv_x_scales, S32Vec& recv_count, S32Mat& src_info, S32Mat& layout_range,
                            S32Mat& msg_token, S32Cube& token_rows, low_latency::DispatchRecvParams* p) {
  const OpConfig& a = st.config();
  const int64_t L = c.num_local, R = c.g.num_ranks, rows = R * c.max_tokens, H = c.hidden;
  const int64_t S = a.use_fp8 ? H / kFp8Block : 0;
  JAX_EP_CHECK(target, recv_x.element_type() == (a.use_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16),
               "recv_x must be float8_e4m3fn with use_fp8, else bfloat16");
  JAX_EP_CHECK_SHAPE(target, "recv_x", recv_x, L, rows, H);
  JAX_EP_CHECK_SHAPE(target, "recv_x_scales", recv_x_scales, L, rows, S);
  JAX_EP_CHECK_SHAPE(target, "recv_count", recv_count, L);
  JAX_EP_CHECK_SHAPE(target, "src_info", src_info, L, rows);
  JAX_EP_CHECK_SHAPE(target, "layout_range", layout_range, L, R);
  p->c = c;
  p->recv_x = recv_x.untyped_data();
  p->recv_x_scales = a.use_fp8 ? recv_x_scales.typed_data() : nullptr;
  p->recv_count = recv_count.typed_data();
  p->src_info = src_info.typed_data();
  p->layout_range = layout_range.typed_data();
  if (auto e = CheckTables(target, st, c, msg_token, token_rows); !e.success()) return e;
  p->msg_token = a.per_rank ? msg_token.typed_data() : nullptr;
  p->token_rows = a.per_rank ? token_rows.typed_data() : nullptr;
  p->num_topk = a.num_topk;
  p->use_fp8 = a.use_fp8;
  p->per_rank = a.per_rank;
  return ffi::Error::Success();
}

ffi::Error FillCombineSend(const char* target, const OpState& st, const low_latency::Ctx& c, const AnyBuf& expert_out,
                           const S32Mat& src_info, const S32Mat& layout_range, const S32Mat& msg_token,
                           const S32Cube& token_rows, const F32Mat& topk_weights, low_latency::CombineSendParams* p) {
  const OpConfig& a = st.config();
  const int64_t L = c.num_local, R = c.g.num_ranks, rows = R * c.max_tokens;
  JAX_EP_CHECK(target, expert_out.element_type() == ffi::DataType::BF16, "expert_out must be bfloat16");
  JAX_EP_CHECK_SHAPE(target, "expert_out", expert_out, L, rows, c.hidden);
  JAX_EP_CHECK_SHAPE(target, "src_info", src_info, L, rows);
  JAX_EP_CHECK_SHAPE(target, "layout_range", layout_range, L, R);
  p->c = c;
  p->expert_out = expert_out.untyped_data();
  p->src_info = src_info.typed_data();
  p->layout_range = layout_range.typed_data();
  if (auto e = CheckTables(target, st, c, msg_token, token_rows); !e.success()) return e;
  const int64_t T = topk_weights.dimensions()[0];
  JAX_EP_CHECK(target, T <= a.max_tokens_per_rank,
               "T=" + std::to_string(T) + " exceeds max_tokens_per_rank=" + std::to_string(a.max_tokens_per_rank));
  JAX_EP_CHECK_SHAPE(target, "topk_weights", topk_weights, T, a.num_topk);
  p->msg_token = a.per_rank ? msg_token.typed_data() : nullptr;
  p->token_rows = a.per_rank ? token_rows.typed_data() : nullptr;
  p->topk_weights = topk_weights.typed_data();
  p->num_tokens = static_cast<int32_t>(T);
  p->num_topk = a.num_topk;
  p->per_rank = a.per_rank;
  return ffi::Error::Success();
}

ffi::Error FillCombineRecv(const char* target, const OpState& st, const low_latency::Ctx& c, const S32Mat& topk_idx,
                           const F32Mat& topk_weights, AnyBuf& y, low_latency::CombineRecvParams* p) {
  const OpConfig& a = st.config();
  const int64_t T = topk_idx.dimensions()[0];
  JAX_EP_CHECK(target, T <= a.max_tokens_per_rank,
               "T=" + std::to_string(T) + " exceeds max_tokens_per_rank=" + std::to_string(a.max_tokens_per_rank));
  JAX_EP_CHECK_SHAPE(target, "topk_idx", topk_idx, T, a.num_topk);
  JAX_EP_CHECK_SHAPE(target, "topk_weights", topk_weights, T, a.num_topk);
  JAX_EP_CHECK(target, y.element_type() == ffi::DataType::BF16, "y must be bfloat16");
  JAX_EP_CHECK_SHAPE(target, "y", y, T, c.hidden);
  p->c = c;
  p->topk_idx = topk_idx.typed_data();
  p->topk_weights = topk_weights.typed_data();
  p->y = y.untyped_data();
  p->num_tokens = static_cast<int32_t>(T);
  p->num_topk = a.num_topk;
  p->per_rank = a.per_rank;
  return ffi::Error::Success();
}

// ---- dispatch -----------------------------------------------------------------------------------------------------
constexpr const char* kDispatch = targets::kLowLatencyDispatch;
constexpr const char* kDispatchSend = targets::kLowLatencyDispatchSend;
constexpr const char* kDispatchRecv = targets::kLowLatencyDispatchRecv;

ffi::Error Dispatch(cudaStream_t stream, int32_t ordinal, OpState* st, AnyBuf x, S32Mat topk_idx, S32Vec state,
                    ffi::Result<AnyBuf> recv_x, ffi::Result<F32Cube> recv_x_scales, ffi::Result<S32Vec> recv_count,
                    ffi::Result<S32Mat> src_info, ffi::Result<S32Mat> layout_range, ffi::Result<S32Mat> msg_token,
                    ffi::Result<S32Cube> token_rows, ffi::Result<S32Vec> state_out) {
  return WithContext(st, ordinal, [&](const low_latency::Ctx& c) -> ffi::Error {
    if (auto e = CheckWords(kDispatch, "state", state); !e.success()) return e;
    if (auto e = CheckWords(kDispatch, "state (result)", *state_out); !e.success()) return e;
    low_latency::DispatchSendParams s{};
    low_latency::DispatchRecvParams r{};
    if (auto e = FillDispatchSend(kDispatch, *st, c, x, topk_idx, &s); !e.success()) return e;
    if (auto e = FillDispatchRecv(kDispatch, *st, c, *recv_x, *recv_x_scales, *recv_count, *src_info,
                                  *layout_range, *msg_token, *token_rows, &r);
        !e.success())
      return e;
    s.fused = true;
    s.io = low_latency::ChainIO{state.typed_data(), state_out->typed_data(), fused_token(c)};
    r.io = low_latency::ChainIO{nullptr, nullptr, fused_token(c)};
    return LaunchOn(kDispatch, ordinal, [&] { return Launch(*st, s, r, stream); });
  });
}

ffi::Error DispatchSend(cudaStream_t stream, int32_t ordinal, OpState* st, AnyBuf x, S32Mat topk_idx, S32Vec state,
                        ffi::Result<S32Vec> token, ffi::Result<S32Vec> state_out) {
  return WithContext(st, ordinal, [&](const low_latency::Ctx& c) -> ffi::Error {
    if (auto e = CheckWords(kDispatchSend, "state", state); !e.success()) return e;
    if (auto e = CheckWords(kDispatchSend, "state (result)", *state_out); !e.success()) return e;
    if (auto e = CheckWords(kDispatchSend, "token", *token); !e.success()) return e;
    low_latency::DispatchSendParams s{};
    if (auto e = FillDispatchSend(kDispatchSend, *st, c, x, topk_idx, &s); !e.success()) return e;
    s.fused = false;
    s.io = low_latency::ChainIO{state.typed_data(), state_out->typed_data(), token->typed_data()};
    return LaunchOn(kDispatchSend, ordinal, [&] { return Launch(*st, s, stream); });
  });
}

ffi::Error DispatchRecv(cudaStream_t stream, int32_t ordinal, OpState* st, S32Vec token, S32Vec state,
                        ffi::Result<AnyBuf> recv_x, ffi::Result<F32Cube> recv_x_scales,
                        ffi::Result<S32Vec> recv_count, ffi::Result<S32Mat> src_info,
                        ffi::Result<S32Mat> layout_range, ffi::Result<S32Mat> msg_token,
                        ffi::Result<S32Cube> token_rows, ffi::Result<S32Vec> state_out) {
  return WithContext(st, ordinal, [&](const low_latency::Ctx& c) -> ffi::Error {
    if (auto e = CheckWords(kDispatchRecv, "token", token); !e.success()) return e;
    if (auto e = CheckWords(kDispatchRecv, "state", state); !e.success()) return e;
    if (auto e = CheckWords(kDispatchRecv, "state (result)", *state_out); !e.success()) return e;
    low_latency::DispatchRecvParams r{};
    if (auto e = FillDispatchRecv(kDispatchRecv, *st, c, *recv_x, *recv_x_scales, *recv_count, *src_info,
                                  *layout_range, *msg_token, *token_rows, &r);
        !e.success())
      return e;
    r.io = low_latency::ChainIO{state.typed_data(), state_out->typed_data(), token.typed_data()};
    return LaunchOn(kDispatchRecv, ordinal, [&] { return Launch(*st, r, stream); });
  });
}

// ---- combine ------------------------------------------------------------------------------------------------------
constexpr const char* kCombine = targets::kLowLatencyCombine;
constexpr const char* kCombineSend = targets::kLowLatencyCombineSend;
constexpr const char* kCombineRecv = targets::kLowLatencyCombineRecv;

ffi::Error Combine(cudaStream_t stream, int32_t ordinal, OpState* st, AnyBuf expert_out, S32Mat src_info,
                   S32Mat layout_range, S32Mat msg_token, S32Cube token_rows, S32Mat topk_idx, F32Mat topk_weights,
                   S32Vec state, ffi::Result<AnyBuf> y, ffi::Result<S32Vec> state_out) {
  return WithContext(st, ordinal, [&](const low_latency::Ctx& c) -> ffi::Error {
    if (auto e = CheckWords(kCombine, "state", state); !e.success()) return e;
    if (auto e = CheckWords(kCombine, "state (result)", *state_out); !e.success()) return e;
    low_latency::CombineSendParams s{};
    low_latency::CombineRecvParams r{};
    if (auto e = FillCombineSend(kCombine, *st, c, expert_out, src_info, layout_range, msg_token, token_rows,
                                 topk_weights, &s);
        !e.success())
      return e;
    if (auto e = FillCombineRecv(kCombine, *st, c, topk_idx, topk_weights, *y, &r); !e.success()) return e;
    s.fused = true;
    s.io = low_latency::ChainIO{state.typed_data(), state_out->typed_data(), fused_token(c)};
    r.io = low_latency::ChainIO{nullptr, nullptr, fused_token(c)};
    return LaunchOn(kCombine, ordinal, [&] { return Launch(*st, s, r, stream); });
  });
}

ffi::Error CombineSend(cudaStream_t stream, int32_t ordinal, OpState* st, AnyBuf expert_out, S32Mat src_info,
                       S32Mat layout_range, S32Mat msg_token, S32Cube token_rows, F32Mat topk_weights,
                       S32Vec state, ffi::Result<S32Vec> token, ffi::Result<S32Vec> state_out) {
  return WithContext(st, ordinal, [&](const low_latency::Ctx& c) -> ffi::Error {
    if (auto e = CheckWords(kCombineSend, "state", state); !e.success()) return e;
    if (auto e = CheckWords(kCombineSend, "state (result)", *state_out); !e.success()) return e;
    if (auto e = CheckWords(kCombineSend, "token", *token); !e.success()) return e;
    low_latency::CombineSendParams s{};
    if (auto e = FillCombineSend(kCombineSend, *st, c, expert_out, src_info, layout_range, msg_token, token_rows,
                                 topk_weights, &s);
        !e.success())
      return e;
    s.fused = false;
    s.io = low_latency::ChainIO{state.typed_data(), state_out->typed_data(), token->typed_data()};
    return LaunchOn(kCombineSend, ordinal, [&] { return Launch(*st, s, stream); });
  });
}

ffi::Error CombineRecv(cudaStream_t stream, int32_t ordinal, OpState* st, S32Vec token, S32Mat topk_idx,
                       F32Mat topk_weights, S32Vec state, ffi::Result<AnyBuf> y, ffi::Result<S32Vec> state_out) {
  return WithContext(st, ordinal, [&](const low_latency::Ctx& c) -> ffi::Error {
    if (auto e = CheckWords(kCombineRecv, "token", token); !e.success()) return e;
    if (auto e = CheckWords(kCombineRecv, "state", state); !e.success()) return e;
    if (auto e = CheckWords(kCombineRecv, "state (result)", *state_out); !e.success()) return e;
    low_latency::CombineRecvParams r{};
    if (auto e = FillCombineRecv(kCombineRecv, *st, c, topk_idx, topk_weights, *y, &r); !e.success()) return e;
    r.io = low_latency::ChainIO{state.typed_data(), state_out->typed_data(), token.typed_data()};
    return LaunchOn(kCombineRecv, ordinal, [&] { return Launch(*st, r, stream); });
  });
}

// ---- instantiate: the LowLatencyAttrs of the call site -> its OpState ----------------------------------------------
using StateOr = ffi::ErrorOr<std::unique_ptr<OpState>>;
StateOr InstantiateDispatch(LowLatencyAttrs a) { return OpState::LowLatency(kDispatch, a); }
StateOr InstantiateDispatchSend(LowLatencyAttrs a) { return OpState::LowLatency(kDispatchSend, a); }
StateOr InstantiateDispatchRecv(LowLatencyAttrs a) { return OpState::LowLatency(kDispatchRecv, a); }
StateOr InstantiateCombine(LowLatencyAttrs a) { return OpState::LowLatency(kCombine, a); }
StateOr InstantiateCombineSend(LowLatencyAttrs a) { return OpState::LowLatency(kCombineSend, a); }
StateOr InstantiateCombineRecv(LowLatencyAttrs a) { return OpState::LowLatency(kCombineRecv, a); }

}  // namespace
}  // namespace jax_ep

namespace ffi = ::xla::ffi;
using namespace jax_ep::ffi_types;  // NOLINT

#define JAX_EP_LOW_LATENCY_INSTANTIATE(symbol, fn) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn, ffi::Ffi::BindInstantiate().Attrs<jax_ep::LowLatencyAttrs>())

JAX_EP_LOW_LATENCY_INSTANTIATE(JaxEpLowLatencyDispatchInstantiateV6, jax_ep::InstantiateDispatch);
JAX_EP_LOW_LATENCY_INSTANTIATE(JaxEpLowLatencyDispatchSendInstantiateV6, jax_ep::InstantiateDispatchSend);
JAX_EP_LOW_LATENCY_INSTANTIATE(JaxEpLowLatencyDispatchRecvInstantiateV6, jax_ep::InstantiateDispatchRecv);
JAX_EP_LOW_LATENCY_INSTANTIATE(JaxEpLowLatencyCombineInstantiateV6, jax_ep::InstantiateCombine);
JAX_EP_LOW_LATENCY_INSTANTIATE(JaxEpLowLatencyCombineSendInstantiateV6, jax_ep::InstantiateCombineSend);
JAX_EP_LOW_LATENCY_INSTANTIATE(JaxEpLowLatencyCombineRecvInstantiateV6, jax_ep::InstantiateCombineRecv);

// Execute stage: the attributes are in the state, the binding takes none.
#define JAX_EP_LOW_LATENCY_EXECUTE_CTX                                                                         \
  ffi::Ffi::Bind()                                                                                    \
      .Ctx<ffi::PlatformStream<cudaStream_t>>() /* XLA's stream for this device */                    \
      .Ctx<ffi::DeviceOrdinal>()                /* resolves the group and the rank */                 \
      .Ctx<ffi::State<jax_ep::OpState>>()       /* the call site: config + per-device cache */

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchCudaV6, jax_ep::Dispatch,
                              JAX_EP_LOW_LATENCY_EXECUTE_CTX
                                  .Arg<AnyBuf>()   // x [T, H] bf16
                                  .Arg<S32Mat>()   // topk_idx [T, K]
                                  .Arg<S32Vec>()   // state [4]
                                  .Ret<AnyBuf>()   // recv_x [L, R*T_max, H] f8e4m3fn | bf16
                                  .Ret<F32Cube>()  // recv_x_scales [L, R*T_max, S]
                                  .Ret<S32Vec>()   // recv_count [L]
                                  .Ret<S32Mat>()   // src_info [L, R*T_max]
                                  .Ret<S32Mat>()   // layout_range [L, R]
                                  .Ret<S32Mat>()   // msg_token [R, T_max | 0]
                                  .Ret<S32Cube>()  // token_rows [R, T_max | 0, K]
                                  .Ret<S32Vec>(),  // state [4] (aliased with the state operand)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchSendCudaV6, jax_ep::DispatchSend,
                              JAX_EP_LOW_LATENCY_EXECUTE_CTX
                                  .Arg<AnyBuf>()   // x [T, H] bf16
                                  .Arg<S32Mat>()   // topk_idx [T, K]
                                  .Arg<S32Vec>()   // state [4]
                                  .Ret<S32Vec>()   // token [4]
                                  .Ret<S32Vec>(),  // state [4] (aliased with the state operand)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyDispatchRecvCudaV6, jax_ep::DispatchRecv,
                              JAX_EP_LOW_LATENCY_EXECUTE_CTX
                                  .Arg<S32Vec>()   // token [4] (from the send)
                                  .Arg<S32Vec>()   // state [4]
                                  .Ret<AnyBuf>()   // recv_x [L, R*T_max, H] f8e4m3fn | bf16
                                  .Ret<F32Cube>()  // recv_x_scales [L, R*T_max, S]
                                  .Ret<S32Vec>()   // recv_count [L]
                                  .Ret<S32Mat>()   // src_info [L, R*T_max]
                                  .Ret<S32Mat>()   // layout_range [L, R]
                                  .Ret<S32Mat>()   // msg_token [R, T_max | 0]
                                  .Ret<S32Cube>()  // token_rows [R, T_max | 0, K]
                                  .Ret<S32Vec>(),  // state [4] (aliased with the state operand)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyCombineCudaV6, jax_ep::Combine,
                              JAX_EP_LOW_LATENCY_EXECUTE_CTX
                                  .Arg<AnyBuf>()   // expert_out [L, R*T_max, H] bf16
                                  .Arg<S32Mat>()   // src_info [L, R*T_max] (handle)
                                  .Arg<S32Mat>()   // layout_range [L, R] (handle)
                                  .Arg<S32Mat>()   // msg_token [R, T_max | 0] (handle, per_rank)
                                  .Arg<S32Cube>()  // token_rows [R, T_max | 0, K] (handle, per_rank)
                                  .Arg<S32Mat>()   // topk_idx [T, K]
                                  .Arg<F32Mat>()   // topk_weights [T, K]
                                  .Arg<S32Vec>()   // state [4]
                                  .Ret<AnyBuf>()   // y [T, H] bf16
                                  .Ret<S32Vec>(),  // state [4] (aliased with the state operand)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyCombineSendCudaV6, jax_ep::CombineSend,
                              JAX_EP_LOW_LATENCY_EXECUTE_CTX
                                  .Arg<AnyBuf>()   // expert_out [L, R*T_max, H] bf16
                                  .Arg<S32Mat>()   // src_info [L, R*T_max] (handle)
                                  .Arg<S32Mat>()   // layout_range [L, R] (handle)
                                  .Arg<S32Mat>()   // msg_token [R, T_max | 0] (handle, per_rank)
                                  .Arg<S32Cube>()  // token_rows [R, T_max | 0, K] (handle, per_rank)
                                  .Arg<F32Mat>()   // topk_weights [T, K] (per_rank: pushed to the expert ranks)
                                  .Arg<S32Vec>()   // state [4]
                                  .Ret<S32Vec>()   // token [4]
                                  .Ret<S32Vec>(),  // state [4] (aliased with the state operand)
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpLowLatencyCombineRecvCudaV6, jax_ep::CombineRecv,
                              JAX_EP_LOW_LATENCY_EXECUTE_CTX
                                  .Arg<S32Vec>()   // token [4] (from the send)
                                  .Arg<S32Mat>()   // topk_idx [T, K]
                                  .Arg<F32Mat>()   // topk_weights [T, K]
                                  .Arg<S32Vec>()   // state [4]
                                  .Ret<AnyBuf>()   // y [T, H] bf16
                                  .Ret<S32Vec>(),  // state [4] (aliased with the state operand)
                              {ffi::Traits::kCmdBufferCompatible});
