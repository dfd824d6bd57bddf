// FFI targets of the intranode (single process, NVLink) normal mode, platform "CUDA":
//   jax_ep_dispatch_v1, jax_ep_cached_dispatch_v1, jax_ep_combine_v1 (operands and results: see the bindings).
//
// Common attributes:
//   group_id (i64)             set id of the intranode group(s) (jax_ep.runtime.group_id_for); each device finds
//                              its own group and rank by its DeviceOrdinal
//   num_experts, hidden, num_topk, max_tokens_per_rank (i32)   the EPConfig: they fix the staging layout
//   num_sms (i32)              blocks of the NVLink-sending kernels
//   timeout_ns (i64)           device waits for a peer trap after this long
// Handlers only decode, validate, fill a Params struct and launch: no allocation, no host synchronization, no
// waiting on other devices (each device's handler runs on its own host thread).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "checks.h"
#include "errors.h"
#include "jax_ep/api.h"
#include "jax_ep/buffer_layout.h"
#include "jax_ep/constants.h"
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
using ffi_util::shape_str;
using ffi_util::ToFfi;
using namespace ffi_types;  // NOLINT

struct CommonAttrs {
  int64_t group_id;
  int32_t num_experts, hidden, num_topk, max_tokens_per_rank, num_sms;
  int64_t timeout_ns;
};

// Group lookup + config checks shared by the three targets. capacity = C of this call.
ffi::Error make_group_ctx(const char* target, int32_t ordinal, const CommonAttrs& a, int64_t capacity,
                          GroupCtx* g, int32_t* sm_count) {
  GroupDeviceView v;
  Status st = find_group_device(a.group_id, ordinal, &v);
  if (!st.ok()) return ToFfi(target, st);
  const int R = v.num_ranks;
  JAX_EP_CHECK(target, a.num_experts > 0 && a.num_experts % R == 0 && a.num_experts <= kMaxLayoutExperts,
               "num_experts (" + std::to_string(a.num_experts) + ") must be a positive multiple of the group size (" +
                   std::to_string(R) + ") and <= " + std::to_string(kMaxLayoutExperts));
  JAX_EP_CHECK(target, a.hidden > 0 && a.max_tokens_per_rank > 0 && capacity > 0,
               "hidden, max_tokens_per_rank and the capacity must be positive");
  JAX_EP_CHECK(target, a.num_topk >= 1 && a.num_topk <= kMaxTopk,
               "num_topk must be in [1, " + std::to_string(kMaxTopk) + "]");
  JAX_EP_CHECK(target, a.num_sms >= 1, "num_sms must be >= 1");
  const BufferLayout layout = make_buffer_layout(a.hidden, a.num_topk, a.max_tokens_per_rank, R, capacity,
                                                 a.num_experts);
  JAX_EP_CHECK(target, layout.total <= v.buffer_bytes,
               "this config needs " + std::to_string(layout.total) + " staging bytes per rank but the group has " +
                   std::to_string(v.buffer_bytes) + " (pass this config to jax_ep.initialize)");
  g->peers = v.peers;
  g->layout = layout;
  g->rank = v.rank;
  g->num_ranks = R;
  g->timeout_ns = static_cast<uint64_t>(a.timeout_ns > 0 ? a.timeout_ns : 1);
  *sm_count = v.sm_count;
  return ffi::Error::Success();
}

int copy_blocks_for(int32_t sm_count) { return sm_count > 0 ? 2 * sm_count : 264; }

// ---- dispatch ---------------------------------------------------------------------------------------------------
constexpr const char* kDispatch = "jax_ep_dispatch_v1";

ffi::Error Dispatch(cudaStream_t stream, int32_t ordinal, AnyBuf x, F32Mat x_scales, S32Mat topk_idx,
                    F32Mat topk_weights, ffi::Result<AnyBuf> recv_x, ffi::Result<F32Mat> recv_x_scales,
                    ffi::Result<S32Mat> recv_topk_idx, ffi::Result<F32Mat> recv_topk_weights,
                    ffi::Result<S32Scalar> num_recv_tokens, ffi::Result<S32Vec> num_recv_tokens_per_expert,
                    ffi::Result<S32Mat> send_pos, ffi::Result<S32Vec> recv_src_idx, ffi::Result<S32Vec> recv_src_rank,
                    ffi::Result<S32Vec> recv_rank_counts, ffi::Result<S32Vec> send_row_offset, int64_t group_id,
                    int32_t num_experts, int32_t hidden, int32_t num_topk, int32_t max_tokens_per_rank, int32_t num_sms,
                    int64_t timeout_ns) {
  return Guarded(kDispatch, [&]() -> ffi::Error {
    const CommonAttrs a{group_id, num_experts, hidden, num_topk, max_tokens_per_rank, num_sms, timeout_ns};
    const auto xd = x.dimensions();
    JAX_EP_CHECK(kDispatch, xd.size() == 2, "x must be [T, H], got " + shape_str(xd));
    const int64_t T = xd[0], H = xd[1];
    const int64_t C = recv_x->dimensions().size() == 2 ? recv_x->dimensions()[0] : -1;
    GroupCtx g{};
    int32_t sm_count = 0;
    if (auto e = make_group_ctx(kDispatch, ordinal, a, C, &g, &sm_count); !e.success()) return e;
    const int64_t R = g.num_ranks, K = num_topk, L = num_experts / R;
    const bool fp8 = x.element_type() == ffi::DataType::F8E4M3FN;
    JAX_EP_CHECK(kDispatch, fp8 || x.element_type() == ffi::DataType::BF16, "x must be bfloat16 or float8_e4m3fn");
    JAX_EP_CHECK(kDispatch, H == hidden, "x has H=" + std::to_string(H) + " but hidden=" + std::to_string(hidden));
    JAX_EP_CHECK(kDispatch, T <= max_tokens_per_rank,
                 "T=" + std::to_string(T) + " exceeds max_tokens_per_rank=" + std::to_string(max_tokens_per_rank));
    const int64_t row_bytes = H * (fp8 ? 1 : 2);
    JAX_EP_CHECK(kDispatch, row_bytes % 16 == 0, "a row of x must be a multiple of 16 bytes (H % 8 == 0 for bf16)");
    JAX_EP_CHECK(kDispatch, !fp8 || H % kFp8Block == 0, "fp8 dispatch needs H % 128 == 0");
    const int64_t S = fp8 ? H / kFp8Block : 0;
    JAX_EP_CHECK_SHAPE(kDispatch, "x_scales", x_scales, T, S);
    JAX_EP_CHECK_SHAPE(kDispatch, "topk_idx", topk_idx, T, K);
    JAX_EP_CHECK_SHAPE(kDispatch, "topk_weights", topk_weights, T, K);
    JAX_EP_CHECK(kDispatch, recv_x->element_type() == x.element_type(), "recv_x must have x's dtype");
    JAX_EP_CHECK_SHAPE(kDispatch, "recv_x", (*recv_x), C, H);
    JAX_EP_CHECK_SHAPE(kDispatch, "recv_x_scales", (*recv_x_scales), C, S);
    JAX_EP_CHECK_SHAPE(kDispatch, "recv_topk_idx", (*recv_topk_idx), C, K);
    JAX_EP_CHECK_SHAPE(kDispatch, "recv_topk_weights", (*recv_topk_weights), C, K);
    JAX_EP_CHECK_SHAPE(kDispatch, "num_recv_tokens_per_expert", (*num_recv_tokens_per_expert), L);
    JAX_EP_CHECK_SHAPE(kDispatch, "send_pos", (*send_pos), T, R);
    JAX_EP_CHECK_SHAPE(kDispatch, "recv_src_idx", (*recv_src_idx), C);
    JAX_EP_CHECK_SHAPE(kDispatch, "recv_src_rank", (*recv_src_rank), C);
    JAX_EP_CHECK_SHAPE(kDispatch, "recv_rank_counts", (*recv_rank_counts), R);
    JAX_EP_CHECK_SHAPE(kDispatch, "send_row_offset", (*send_row_offset), R);

    DispatchParams p{};
    p.g = g;
    p.x = x.untyped_data();
    p.x_scales = fp8 ? x_scales.typed_data() : nullptr;
    p.topk_idx = topk_idx.typed_data();
    p.topk_weights = topk_weights.typed_data();
    p.recv_x = recv_x->untyped_data();
    p.recv_x_scales = fp8 ? recv_x_scales->typed_data() : nullptr;
    p.recv_topk_idx = recv_topk_idx->typed_data();
    p.recv_topk_weights = recv_topk_weights->typed_data();
    p.num_recv_tokens = num_recv_tokens->typed_data();
    p.num_recv_tokens_per_expert = num_recv_tokens_per_expert->typed_data();
    p.send_pos = send_pos->typed_data();
    p.recv_src_idx = recv_src_idx->typed_data();
    p.recv_src_rank = recv_src_rank->typed_data();
    p.recv_rank_counts = recv_rank_counts->typed_data();
    p.send_row_offset = send_row_offset->typed_data();
    p.num_tokens = static_cast<int32_t>(T);
    p.num_topk = static_cast<int32_t>(K);
    p.num_experts = num_experts;
    p.capacity = static_cast<int32_t>(C);
    p.row_bytes = static_cast<int32_t>(row_bytes);
    p.scale_cols = static_cast<int32_t>(S);
    p.num_sms = num_sms;
    p.copy_blocks = copy_blocks_for(sm_count);
    if (Status st = ensure_device(ordinal); !st.ok()) return ToFfi(kDispatch, st);
    return ToFfi(kDispatch, launch_dispatch(p, stream));
  });
}

// ---- cached dispatch --------------------------------------------------------------------------------------------
constexpr const char* kCached = "jax_ep_cached_dispatch_v1";

int64_t payload_elem_bytes(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? 2 : (t == ffi::DataType::F32 ? 4 : 0);
}

// Checks shared by cached dispatch and combine: the moved rows ([rows, W] bf16/f32 that fit a staging slot), the
// optional weights ([weight_rows, Kw], Kw = 0 for none) and the handle arrays. Writes the row size in bytes.
ffi::Error CheckRowsAndHandle(const char* target, const CommonAttrs& a, const GroupCtx& g, const AnyBuf& rows,
                              int64_t T, int64_t C, const F32Mat& weights, int64_t weight_rows, const S32Mat& send_pos,
                              const S32Vec& recv_src_idx, const S32Vec& recv_src_rank,
                              const S32Vec& recv_rank_counts, const S32Vec& send_row_offset, int64_t* row_bytes_out) {
  const int64_t R = g.num_ranks;
  const int64_t elem = payload_elem_bytes(rows.element_type());
  JAX_EP_CHECK(target, elem > 0, "payload / values must be bfloat16 or float32");
  const int64_t row_bytes = rows.dimensions()[1] * elem;
  JAX_EP_CHECK(target, row_bytes % 16 == 0 && row_bytes <= g.layout.payload_stride,
               "rows must be a multiple of 16 bytes and at most 4 * hidden bytes, got " + std::to_string(row_bytes));
  JAX_EP_CHECK(target, T <= a.max_tokens_per_rank, "T exceeds max_tokens_per_rank");
  JAX_EP_CHECK(target, weights.dimensions()[0] == weight_rows && weights.dimensions()[1] <= a.num_topk,
               "weights must be [" + std::to_string(weight_rows) + ", Kw] with Kw <= num_topk (0 = none), got " +
                   shape_str(weights.dimensions()));
  JAX_EP_CHECK_SHAPE(target, "send_pos", send_pos, T, R);
  JAX_EP_CHECK_SHAPE(target, "recv_src_idx", recv_src_idx, C);
  JAX_EP_CHECK_SHAPE(target, "recv_src_rank", recv_src_rank, C);
  JAX_EP_CHECK_SHAPE(target, "recv_rank_counts", recv_rank_counts, R);
  JAX_EP_CHECK_SHAPE(target, "send_row_offset", send_row_offset, R);
  *row_bytes_out = row_bytes;
  return ffi::Error::Success();
}

ffi::Error CachedDispatch(cudaStream_t stream, int32_t ordinal, AnyBuf payload, F32Mat weights, S32Mat send_pos,
                          S32Vec recv_src_idx, S32Vec recv_src_rank, S32Vec recv_rank_counts, S32Vec send_row_offset,
                          ffi::Result<AnyBuf> recv, ffi::Result<F32Mat> recv_weights, int64_t group_id,
                          int32_t num_experts, int32_t hidden, int32_t num_topk, int32_t max_tokens_per_rank,
                          int32_t num_sms, int64_t timeout_ns) {
  return Guarded(kCached, [&]() -> ffi::Error {
    const CommonAttrs a{group_id, num_experts, hidden, num_topk, max_tokens_per_rank, num_sms, timeout_ns};
    const auto pd = payload.dimensions();
    JAX_EP_CHECK(kCached, pd.size() == 2, "payload must be [T, W], got " + shape_str(pd));
    const int64_t T = pd[0], W = pd[1];
    const int64_t C = recv_src_idx.dimensions()[0];
    GroupCtx g{};
    int32_t sm_count = 0;
    if (auto e = make_group_ctx(kCached, ordinal, a, C, &g, &sm_count); !e.success()) return e;
    int64_t row_bytes = 0;
    if (auto e = CheckRowsAndHandle(kCached, a, g, payload, T, C, weights, T, send_pos, recv_src_idx, recv_src_rank,
                                    recv_rank_counts, send_row_offset, &row_bytes);
        !e.success())
      return e;
    const int64_t Kw = weights.dimensions()[1];
    JAX_EP_CHECK(kCached, recv->element_type() == payload.element_type(), "recv must have the payload's dtype");
    JAX_EP_CHECK_SHAPE(kCached, "recv", (*recv), C, W);
    JAX_EP_CHECK_SHAPE(kCached, "recv_weights", (*recv_weights), C, Kw);

    CachedDispatchParams p{};
    p.g = g;
    p.payload = payload.untyped_data();
    p.weights = Kw > 0 ? weights.typed_data() : nullptr;
    p.send_pos = send_pos.typed_data();
    p.recv_rank_counts = recv_rank_counts.typed_data();
    p.send_row_offset = send_row_offset.typed_data();
    p.recv = recv->untyped_data();
    p.recv_weights = Kw > 0 ? recv_weights->typed_data() : nullptr;
    p.num_tokens = static_cast<int32_t>(T);
    p.num_weights = static_cast<int32_t>(Kw);
    p.capacity = static_cast<int32_t>(C);
    p.row_bytes = static_cast<int32_t>(row_bytes);
    p.num_sms = num_sms;
    p.copy_blocks = copy_blocks_for(sm_count);
    if (Status st = ensure_device(ordinal); !st.ok()) return ToFfi(kCached, st);
    return ToFfi(kCached, launch_cached_dispatch(p, stream));
  });
}

// ---- combine ----------------------------------------------------------------------------------------------------
constexpr const char* kCombine = "jax_ep_combine_v1";

ffi::Error Combine(cudaStream_t stream, int32_t ordinal, AnyBuf values, F32Mat weights, S32Mat send_pos,
                   S32Vec recv_src_idx, S32Vec recv_src_rank, S32Vec recv_rank_counts, S32Vec send_row_offset,
                   ffi::Result<AnyBuf> y, ffi::Result<F32Mat> y_weights, int64_t group_id, int32_t num_experts,
                   int32_t hidden, int32_t num_topk, int32_t max_tokens_per_rank, int32_t num_sms,
                   int64_t timeout_ns) {
  return Guarded(kCombine, [&]() -> ffi::Error {
    const CommonAttrs a{group_id, num_experts, hidden, num_topk, max_tokens_per_rank, num_sms, timeout_ns};
    const auto vd = values.dimensions();
    JAX_EP_CHECK(kCombine, vd.size() == 2, "values must be [C, W], got " + shape_str(vd));
    const int64_t C = vd[0], W = vd[1];
    const int64_t T = send_pos.dimensions()[0];
    GroupCtx g{};
    int32_t sm_count = 0;
    if (auto e = make_group_ctx(kCombine, ordinal, a, C, &g, &sm_count); !e.success()) return e;
    int64_t row_bytes = 0;
    if (auto e = CheckRowsAndHandle(kCombine, a, g, values, T, C, weights, C, send_pos, recv_src_idx, recv_src_rank,
                                    recv_rank_counts, send_row_offset, &row_bytes);
        !e.success())
      return e;
    const int64_t Kw = weights.dimensions()[1];
    const int64_t elem = payload_elem_bytes(values.element_type());
    JAX_EP_CHECK(kCombine, y->element_type() == values.element_type(), "y must have the values' dtype");
    JAX_EP_CHECK_SHAPE(kCombine, "y", (*y), T, W);
    JAX_EP_CHECK_SHAPE(kCombine, "y_weights", (*y_weights), T, Kw);

    CombineParams p{};
    p.g = g;
    p.values = values.untyped_data();
    p.weights = Kw > 0 ? weights.typed_data() : nullptr;
    p.send_pos = send_pos.typed_data();
    p.recv_src_idx = recv_src_idx.typed_data();
    p.recv_src_rank = recv_src_rank.typed_data();
    p.recv_rank_counts = recv_rank_counts.typed_data();
    p.send_row_offset = send_row_offset.typed_data();
    p.y = y->untyped_data();
    p.y_weights = Kw > 0 ? y_weights->typed_data() : nullptr;
    p.dtype = elem == 2 ? CombineDtype::kBF16 : CombineDtype::kF32;
    p.num_tokens = static_cast<int32_t>(T);
    p.max_tokens_per_rank = max_tokens_per_rank;
    p.num_weights = static_cast<int32_t>(Kw);
    p.capacity = static_cast<int32_t>(C);
    p.row_bytes = static_cast<int32_t>(row_bytes);
    p.num_sms = num_sms;
    p.copy_blocks = copy_blocks_for(sm_count);
    if (Status st = ensure_device(ordinal); !st.ok()) return ToFfi(kCombine, st);
    return ToFfi(kCombine, launch_combine(p, stream));
  });
}

}  // namespace
}  // namespace jax_ep

namespace ffi = ::xla::ffi;
using namespace jax_ep::ffi_types;  // NOLINT

#define JAX_EP_COMMON_ATTRS                           \
  .Attr<int64_t>("group_id")                          \
      .Attr<int32_t>("num_experts")                   \
      .Attr<int32_t>("hidden")                        \
      .Attr<int32_t>("num_topk")                      \
      .Attr<int32_t>("max_tokens_per_rank")           \
      .Attr<int32_t>("num_sms")                       \
      .Attr<int64_t>("timeout_ns")

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchCudaV1, jax_ep::Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
                                  .Ctx<ffi::DeviceOrdinal>()                 // finds the group and the rank
                                  .Arg<AnyBuf>()     // x [T, H] bf16 | f8e4m3fn
                                  .Arg<F32Mat>()     // x_scales [T, H/128] f32 (fp8), [T, 0] for bf16
                                  .Arg<S32Mat>()     // topk_idx [T, K]
                                  .Arg<F32Mat>()     // topk_weights [T, K]
                                  .Ret<AnyBuf>()     // recv_x [C, H]
                                  .Ret<F32Mat>()     // recv_x_scales [C, H/128] ([C, 0] for bf16)
                                  .Ret<S32Mat>()     // recv_topk_idx [C, K]
                                  .Ret<F32Mat>()     // recv_topk_weights [C, K]
                                  .Ret<S32Scalar>()  // num_recv_tokens []
                                  .Ret<S32Vec>()     // num_recv_tokens_per_expert [L]
                                  .Ret<S32Mat>()     // handle.send_pos [T, R]
                                  .Ret<S32Vec>()     // handle.recv_src_idx [C]
                                  .Ret<S32Vec>()     // handle.recv_src_rank [C]
                                  .Ret<S32Vec>()     // handle.recv_rank_counts [R]
                                  .Ret<S32Vec>()     // handle.send_row_offset [R]
                                  JAX_EP_COMMON_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCachedDispatchCudaV1, jax_ep::CachedDispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
                                  .Ctx<ffi::DeviceOrdinal>()                 // finds the group and the rank
                                  .Arg<AnyBuf>()   // payload [T, W] bf16 | f32
                                  .Arg<F32Mat>()   // weights [T, Kw] f32 (Kw = 0: none)
                                  .Arg<S32Mat>()   // handle.send_pos [T, R]
                                  .Arg<S32Vec>()   // handle.recv_src_idx [C]
                                  .Arg<S32Vec>()   // handle.recv_src_rank [C]
                                  .Arg<S32Vec>()   // handle.recv_rank_counts [R]
                                  .Arg<S32Vec>()   // handle.send_row_offset [R]
                                  .Ret<AnyBuf>()   // recv [C, W]
                                  .Ret<F32Mat>()   // recv_weights [C, Kw]
                                  JAX_EP_COMMON_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineCudaV1, jax_ep::Combine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
                                  .Ctx<ffi::DeviceOrdinal>()                 // finds the group and the rank
                                  .Arg<AnyBuf>()   // values [C, W] bf16 | f32
                                  .Arg<F32Mat>()   // weights [C, Kw] f32 (Kw = 0: none)
                                  .Arg<S32Mat>()   // handle.send_pos [T, R]
                                  .Arg<S32Vec>()   // handle.recv_src_idx [C]
                                  .Arg<S32Vec>()   // handle.recv_src_rank [C]
                                  .Arg<S32Vec>()   // handle.recv_rank_counts [R]
                                  .Arg<S32Vec>()   // handle.send_row_offset [R]
                                  .Ret<AnyBuf>()   // y [T, W] values dtype
                                  .Ret<F32Mat>()   // y_weights [T, Kw] f32
                                  JAX_EP_COMMON_ATTRS,
                              {ffi::Traits::kCmdBufferCompatible});
