// FFI targets of the normal mode (training, prefill), platform "CUDA", stateful bundles {instantiate, execute}:
//   jax_ep_dispatch_v4, jax_ep_cached_dispatch_v4, jax_ep_combine_v4 (operands and results: see the bindings).
//
// Attributes: NormalAttrs (attrs.h), decoded once per call site by the instantiate stage into an OpState.
// Execute resolves (axis, DeviceOrdinal) through the state (op_state.h), checks shapes, fills a Params struct and
// launches: no allocation, no host synchronization, no waiting on other devices (each device's handler runs on its
// own host thread).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "attrs.h"
#include "checks.h"
#include "direct_buffers.h"
#include "errors.h"
#include "jax_ep/api.h"
#include "jax_ep/constants.h"
#include "jax_ep/staging_layout.h"
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
using ffi_util::Invalid;
using ffi_util::shape_str;
using ffi_util::ToFfi;
using namespace ffi_types;  // NOLINT
using normal::CachedDispatchParams;
using normal::CombineDtype;
using normal::CombineParams;
using normal::DispatchParams;

// Resolves the call site on this device and lays out this call's config (capacity C) in the normal region.
// view (optional): the group as this device resolved it (GroupDeviceView::in_process, device_mask).
ffi::Error make_group_ctx(OpState* st, int32_t ordinal, int64_t capacity, GroupCtx* g, int32_t* sm_count,
                          const GroupDeviceView** view = nullptr) {
  const char* target = st->target();
  const Resolved* r = nullptr;
  if (auto e = st->resolve(ordinal, &r); !e.success()) return e;
  const OpConfig& a = st->config();
  JAX_EP_CHECK(target, capacity > 0, "the capacity (rows of the receive buffers) must be positive");
  const BufferLayout layout = make_buffer_layout(a.hidden, a.num_topk, a.max_tokens_per_rank, r->view.num_ranks,
                                                 capacity, a.num_experts, a.nvshmem, a.nvl_domain);
  JAX_EP_CHECK(target, layout.total <= r->normal_limit,
               "this config needs " + std::to_string(layout.total) + " staging bytes per rank but the runtime has " +
                   std::to_string(r->normal_limit) + " (pass this config to jax_ep.initialize)");
  *g = st->group_ctx(*r);
  g->layout = layout;
  *sm_count = r->view.sm_count;
  if (view != nullptr) *view = &r->view;
  return ffi::Error::Success();
}

int copy_blocks_for(int32_t sm_count) { return sm_count > 0 ? 2 * sm_count : 264; }

// ---- dispatch ---------------------------------------------------------------------------------------------------
constexpr const char* kDispatch = targets::kDispatch;

ffi::Error Dispatch(cudaStream_t stream, int32_t ordinal, OpState* st, AnyBuf x, F32Mat x_scales, S32Mat topk_idx,
                    F32Mat topk_weights, ffi::Result<AnyBuf> recv_x, ffi::Result<F32Mat> recv_x_scales,
                    ffi::Result<S32Mat> recv_topk_idx, ffi::Result<F32Mat> recv_topk_weights,
                    ffi::Result<S32Scalar> num_recv_tokens, ffi::Result<S32Vec> num_recv_tokens_per_expert,
                    ffi::Result<S32Mat> send_pos, ffi::Result<S32Vec> recv_src_idx, ffi::Result<S32Vec> recv_src_rank,
                    ffi::Result<S32Vec> recv_rank_counts, ffi::Result<S32Vec> send_row_offset) {
  return Guarded(kDispatch, [&]() -> ffi::Error {
    const OpConfig& a = st->config();
    const int32_t hidden = a.hidden, num_topk = a.num_topk, num_experts = a.num_experts;
    const int32_t max_tokens_per_rank = a.max_tokens_per_rank, num_sms = a.num_sms;
    const auto xd = x.dimensions();
    JAX_EP_CHECK(kDispatch, xd.size() == 2, "x must be [T, H], got " + shape_str(xd));
    const int64_t T = xd[0], H = xd[1];
    const int64_t C = recv_x->dimensions().size() == 2 ? recv_x->dimensions()[0] : -1;
    GroupCtx g{};
    int32_t sm_count = 0;
    const GroupDeviceView* view = nullptr;
    if (auto e = make_group_ctx(st, ordinal, C, &g, &sm_count, &view); !e.success()) return e;
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
    p.max_tokens_per_rank = max_tokens_per_rank;
    p.row_bytes = static_cast<int32_t>(row_bytes);
    p.scale_cols = static_cast<int32_t>(S);
    p.num_sms = num_sms;
    p.copy_blocks = copy_blocks_for(sm_count);
    if (Status s = ensure_device(ordinal); !s.ok()) return ToFfi(kDispatch, s);
    // Direct receive: the NVLink kernels (no rank behind NVSHMEM), where the peers can address these outputs: in
    // one process every device maps them (normal_params.h: RecvTargets); with one process per GPU, outputs inside
    // this rank's receive pool, which every peer mapped (receive_pools.h).
    const std::initializer_list<direct_buffers::Extent> outputs = {
        {p.recv_x, C * row_bytes}, {p.recv_x_scales, C * S * 4}, {p.recv_topk_idx, C * K * 4},
        {p.recv_topk_weights, C * K * 4}, {p.recv_src_idx, C * 4}, {p.recv_src_rank, C * 4}};
    const bool pooled = !view->in_process && view->receive_pool_end > view->receive_pool_begin;
    p.direct_receive = !g.remote.any() && direct_buffers::enabled() &&
                       (view->in_process ? direct_buffers::peer_addressable(outputs, view->device_mask)
                                         : pooled && direct_buffers::within(outputs, view->receive_pool_begin,
                                                                            view->receive_pool_end));
    for (int d = 0; d < kMaxNvlPeers; ++d) p.receive_delta[d] = pooled ? view->receive_delta[d] : 0;
    if (p.direct_receive) direct_buffers::count_call();
    // Across processes without receive pools no rank takes direct receive, so all of them receive through staging;
    // with pools (every rank of the group has one, or none does) each rank decides for itself, as in one process.
    p.every_rank_staged = !view->in_process && !pooled;
    if (test_hooks::skip_launch(p.g.rank)) return ffi::Error::Success();
    return ToFfi(kDispatch, normal::launch_dispatch(p, stream));
  });
}

// ---- cached dispatch --------------------------------------------------------------------------------------------
constexpr const char* kCached = targets::kCachedDispatch;

int64_t payload_elem_bytes(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? 2 : (t == ffi::DataType::F32 ? 4 : 0);
}

// Checks shared by cached dispatch and combine: the moved rows ([rows, W] bf16/f32 that fit a staging slot), the
// optional weights ([weight_rows, Kw], Kw = 0 for none) and the handle arrays. Writes the row size in bytes.
ffi::Error CheckRowsAndHandle(const char* target, const OpConfig& a, const GroupCtx& g, const AnyBuf& rows,
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

ffi::Error CachedDispatch(cudaStream_t stream, int32_t ordinal, OpState* st, AnyBuf payload, F32Mat weights,
                          S32Mat send_pos, S32Vec recv_src_idx, S32Vec recv_src_rank, S32Vec recv_rank_counts,
                          S32Vec send_row_offset, ffi::Result<AnyBuf> recv, ffi::Result<F32Mat> recv_weights) {
  return Guarded(kCached, [&]() -> ffi::Error {
    const OpConfig& a = st->config();
    const auto pd = payload.dimensions();
    JAX_EP_CHECK(kCached, pd.size() == 2, "payload must be [T, W], got " + shape_str(pd));
    const int64_t T = pd[0], W = pd[1];
    const int64_t C = recv_src_idx.dimensions()[0];
    GroupCtx g{};
    int32_t sm_count = 0;
    if (auto e = make_group_ctx(st, ordinal, C, &g, &sm_count); !e.success()) return e;
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
    p.max_tokens_per_rank = a.max_tokens_per_rank;
    p.row_bytes = static_cast<int32_t>(row_bytes);
    p.num_sms = a.num_sms;
    p.copy_blocks = copy_blocks_for(sm_count);
    if (Status s = ensure_device(ordinal); !s.ok()) return ToFfi(kCached, s);
    if (test_hooks::skip_launch(p.g.rank)) return ffi::Error::Success();
    return ToFfi(kCached, normal::launch_cached_dispatch(p, stream));
  });
}

// ---- combine ----------------------------------------------------------------------------------------------------
constexpr const char* kCombine = targets::kCombine;

ffi::Error Combine(cudaStream_t stream, int32_t ordinal, OpState* st, AnyBuf values, F32Mat weights, S32Mat send_pos,
                   S32Vec recv_src_idx, S32Vec recv_src_rank, S32Vec recv_rank_counts, S32Vec send_row_offset,
                   ffi::Result<AnyBuf> y, ffi::Result<F32Mat> y_weights) {
  return Guarded(kCombine, [&]() -> ffi::Error {
    const OpConfig& a = st->config();
    const auto vd = values.dimensions();
    JAX_EP_CHECK(kCombine, vd.size() == 2, "values must be [C, W], got " + shape_str(vd));
    const int64_t C = vd[0], W = vd[1];
    const int64_t T = send_pos.dimensions()[0];
    GroupCtx g{};
    int32_t sm_count = 0;
    const GroupDeviceView* view = nullptr;
    if (auto e = make_group_ctx(st, ordinal, C, &g, &sm_count, &view); !e.success()) return e;
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
    p.max_tokens_per_rank = a.max_tokens_per_rank;
    p.num_weights = static_cast<int32_t>(Kw);
    p.capacity = static_cast<int32_t>(C);
    p.row_bytes = static_cast<int32_t>(row_bytes);
    p.num_sms = a.num_sms;
    p.copy_blocks = copy_blocks_for(sm_count);
    if (Status s = ensure_device(ordinal); !s.ok()) return ToFfi(kCombine, s);
    // Pull combine when every rank publishes (normal_params.h: CombineSource): this rank's inputs must be
    // addressable by its peers (direct buffers, as dispatch's outputs for direct receive), and the output large
    // enough (direct_buffers.h: pull_combine_min_bytes; every rank decides alike).
    p.publish = view->in_process && !g.remote.any() && direct_buffers::enabled() &&
                T * row_bytes >= direct_buffers::pull_combine_min_bytes() &&
                direct_buffers::peer_addressable({{p.values, C * row_bytes}, {p.weights, C * Kw * 4}},
                                                 view->device_mask);
    if (p.publish) direct_buffers::count_call();
    if (test_hooks::skip_launch(p.g.rank)) return ffi::Error::Success();
    return ToFfi(kCombine, normal::launch_combine(p, stream));
  });
}

ffi::ErrorOr<std::unique_ptr<OpState>> InstantiateDispatch(NormalAttrs a) { return OpState::Normal(kDispatch, a); }
ffi::ErrorOr<std::unique_ptr<OpState>> InstantiateCached(NormalAttrs a) { return OpState::Normal(kCached, a); }
ffi::ErrorOr<std::unique_ptr<OpState>> InstantiateCombine(NormalAttrs a) { return OpState::Normal(kCombine, a); }

}  // namespace
}  // namespace jax_ep

namespace ffi = ::xla::ffi;
using namespace jax_ep::ffi_types;  // NOLINT

// Instantiate stage: the NormalAttrs of the call site -> its OpState.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchInstantiateV4, jax_ep::InstantiateDispatch,
                              ffi::Ffi::BindInstantiate().Attrs<jax_ep::NormalAttrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCachedDispatchInstantiateV4, jax_ep::InstantiateCached,
                              ffi::Ffi::BindInstantiate().Attrs<jax_ep::NormalAttrs>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineInstantiateV4, jax_ep::InstantiateCombine,
                              ffi::Ffi::BindInstantiate().Attrs<jax_ep::NormalAttrs>());

// Execute stage (the attributes are in the state; the binding takes none).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchCudaV4, jax_ep::Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
                                  .Ctx<ffi::DeviceOrdinal>()                 // finds the group and the rank
                                  .Ctx<ffi::State<jax_ep::OpState>>()        // the call site (attrs, cache)
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
                                  .Ret<S32Vec>(),    // handle.send_row_offset [R]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCachedDispatchCudaV4, jax_ep::CachedDispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
                                  .Ctx<ffi::DeviceOrdinal>()                 // finds the group and the rank
                                  .Ctx<ffi::State<jax_ep::OpState>>()        // the call site (attrs, cache)
                                  .Arg<AnyBuf>()   // payload [T, W] bf16 | f32
                                  .Arg<F32Mat>()   // weights [T, Kw] f32 (Kw = 0: none)
                                  .Arg<S32Mat>()   // handle.send_pos [T, R]
                                  .Arg<S32Vec>()   // handle.recv_src_idx [C]
                                  .Arg<S32Vec>()   // handle.recv_src_rank [C]
                                  .Arg<S32Vec>()   // handle.recv_rank_counts [R]
                                  .Arg<S32Vec>()   // handle.send_row_offset [R]
                                  .Ret<AnyBuf>()   // recv [C, W]
                                  .Ret<F32Mat>(),  // recv_weights [C, Kw]
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineCudaV4, jax_ep::Combine,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream for this device
                                  .Ctx<ffi::DeviceOrdinal>()                 // finds the group and the rank
                                  .Ctx<ffi::State<jax_ep::OpState>>()        // the call site (attrs, cache)
                                  .Arg<AnyBuf>()   // values [C, W] bf16 | f32
                                  .Arg<F32Mat>()   // weights [C, Kw] f32 (Kw = 0: none)
                                  .Arg<S32Mat>()   // handle.send_pos [T, R]
                                  .Arg<S32Vec>()   // handle.recv_src_idx [C]
                                  .Arg<S32Vec>()   // handle.recv_src_rank [C]
                                  .Arg<S32Vec>()   // handle.recv_rank_counts [R]
                                  .Arg<S32Vec>()   // handle.send_row_offset [R]
                                  .Ret<AnyBuf>()   // y [T, W] values dtype
                                  .Ret<F32Mat>(),  // y_weights [T, Kw] f32
                              {ffi::Traits::kCmdBufferCompatible});
