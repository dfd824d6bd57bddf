#include "op_state.h"

#include <string>
#include <utility>

#include "errors.h"
#include "jax_ep/constants.h"
#include "jax_ep/staging_layout.h"

namespace jax_ep {

namespace ffi = ::xla::ffi;

ffi::TypeId OpState::id = {};

namespace {

// Checks shared by both modes (independent of the group). Empty string: fine.
std::string check_common(std::string_view axis, int32_t num_experts, int32_t hidden, int32_t num_topk,
                         int32_t max_tokens_per_rank, int64_t timeout_ns) {
  if (axis.empty()) return "attribute axis (the EP mesh axis name) is empty";
  if (num_experts <= 0) return "num_experts must be positive, got " + std::to_string(num_experts);
  if (hidden <= 0) return "hidden must be positive, got " + std::to_string(hidden);
  if (max_tokens_per_rank <= 0)
    return "max_tokens_per_rank must be positive, got " + std::to_string(max_tokens_per_rank);
  if (num_topk < 1 || num_topk > kMaxTopk)
    return "num_topk must be in [1, " + std::to_string(kMaxTopk) + "], got " + std::to_string(num_topk);
  if (timeout_ns < 0) return "timeout_ns must be >= 0, got " + std::to_string(timeout_ns);
  return {};
}

uint64_t timeout_of(int64_t ns) { return static_cast<uint64_t>(ns > 0 ? ns : 1); }

// The config fields both attribute structs share.
template <typename Attrs>
OpConfig base_config(const Attrs& a) {
  OpConfig c;
  c.num_experts = a.num_experts;
  c.hidden = a.hidden;
  c.num_topk = a.num_topk;
  c.max_tokens_per_rank = a.max_tokens_per_rank;
  c.timeout_ns = timeout_of(a.timeout_ns);
  return c;
}

}  // namespace

ffi::ErrorOr<std::unique_ptr<OpState>> OpState::Normal(const char* target, const NormalAttrs& a) {
  std::string err = check_common(a.axis, a.num_experts, a.hidden, a.num_topk, a.max_tokens_per_rank, a.timeout_ns);
  if (err.empty() && a.num_experts > kMaxLayoutExperts)
    err = "num_experts must be <= " + std::to_string(kMaxLayoutExperts) + ", got " + std::to_string(a.num_experts);
  if (err.empty() && a.num_sms < 1) err = "num_sms must be >= 1, got " + std::to_string(a.num_sms);
  // rows and node-first combine partials move as 16-byte vectors in slots of payload_stride = 4 * hidden bytes
  if (err.empty() && a.hidden % 8 != 0) err = "hidden must be a multiple of 8, got " + std::to_string(a.hidden);
  if (err.empty() && a.nvshmem != 0 && a.nvl_domain < 1)
    err = "nvl_domain must be >= 1, got " + std::to_string(a.nvl_domain);
  if (!err.empty()) return ffi::Unexpected(ffi_util::Invalid(target, err));
  OpConfig c = base_config(a);
  c.num_sms = a.num_sms;
  c.nvshmem = a.nvshmem != 0;
  c.nvl_domain = a.nvl_domain;
  return std::unique_ptr<OpState>(new OpState(target, OpMode::kNormal, std::string(a.axis), c));
}

ffi::ErrorOr<std::unique_ptr<OpState>> OpState::LowLatency(const char* target, const LowLatencyAttrs& a) {
  std::string err = check_common(a.axis, a.num_experts, a.hidden, a.num_topk, a.max_tokens_per_rank, a.timeout_ns);
  if (err.empty() && a.num_experts > kMaxLowLatencyExperts)
    err = "num_experts must be <= " + std::to_string(kMaxLowLatencyExperts) + " in low-latency mode, got " +
          std::to_string(a.num_experts);
  if (err.empty() && a.hidden % 8 != 0) err = "hidden must be a multiple of 8, got " + std::to_string(a.hidden);
  if (err.empty() && a.use_fp8 != 0 && a.hidden % kFp8Block != 0)
    err = "fp8 dispatch needs hidden % 128 == 0, got hidden=" + std::to_string(a.hidden);
  if (err.empty() && a.nvshmem != 0 && a.per_rank != 0)
    err = "the NVSHMEM low-latency kernels (allow_nvlink_for_low_latency=False or R > num_max_nvl_peers) need "
          "low_latency_mode='per_expert'";
  if (err.empty() && a.nvshmem != 0 && a.nvl_domain < 1)
    err = "nvl_domain must be >= 1, got " + std::to_string(a.nvl_domain);
  if (!err.empty()) return ffi::Unexpected(ffi_util::Invalid(target, err));
  OpConfig c = base_config(a);
  c.use_fp8 = a.use_fp8 != 0;
  c.per_rank = a.per_rank != 0;
  c.nvshmem = a.nvshmem != 0;
  c.nvl_domain = a.nvl_domain;
  return std::unique_ptr<OpState>(new OpState(target, OpMode::kLowLatency, std::string(a.axis), c));
}

GroupCtx OpState::group_ctx(const Resolved& r) const {
  GroupCtx g{};
  g.peers = r.view.peers;
  g.rank = r.view.rank;
  g.num_ranks = r.view.num_ranks;
  g.timeout_ns = config_.timeout_ns;
  for (int q = 0; q < kMaxGroupRanks; ++q) g.pe[q] = r.view.pe[q];
  g.remote = mode_ == OpMode::kNormal ? r.normal_remote : RankMask::none();
  g.forward_nvl = mode_ == OpMode::kNormal ? r.normal_forward_nvl : 0;
  return g;
}

// Checks of this config against the group found (its size R, its buffer) and the bound LL region.
ffi::Error OpState::validate(const ResolvedGroup& rg, Resolved* out) const {
  const int R = rg.view.num_ranks;
  const OpConfig& c = config_;
  if (R < 1 || c.num_experts % R != 0)
    return ffi_util::Invalid(target_, "num_experts (" + std::to_string(c.num_experts) +
                                          ") must be a multiple of the group size (" + std::to_string(R) + ")");
  out->alive = rg.alive;
  out->view = rg.view;
  out->binding = rg.binding;
  out->normal_limit = rg.binding.low_latency_bytes > 0 ? rg.binding.low_latency_offset : rg.view.buffer_bytes;
  // The NVSHMEM normal-mode kernels reach the ranks of other NVLink domains, and any rank without a pointer, by
  // puts; they need this rank to be an NVSHMEM PE.
  if (mode_ == OpMode::kNormal && c.nvshmem) {
    if (rg.view.pe[rg.view.rank] < 0)
      return ffi_util::Precondition(target_, "the NVSHMEM normal-mode kernels (R > num_max_nvl_peers) move rows with "
                                             "NVSHMEM puts, but the group of mesh axis '" + axis_ + "' is not an "
                                             "NVSHMEM group: run one process per GPU (python -m jax_ep.launch)");
    out->normal_remote = low_latency::remote_ranks(rg.view.rank, R, c.nvl_domain);
    for (int q = 0; q < R; ++q)
      if (rg.view.peers.base[q] == nullptr) out->normal_remote.set(q);
    out->normal_remote.clear(rg.view.rank);  // this rank's own rows always move by stores
    // Forwarding (hierarchical dispatch, node-first combine) needs every rank of this rank's node mapped (the
    // forwarder stores into them). No fallback to the flat kernels: the other nodes would still forward, and the
    // ranks would wait for announcements that never come (initialize checks it first: check_unmapped).
    out->normal_forward_nvl = 0;
    if (forward_nodes(R, c.nvl_domain) > 0) {
      const RankMask unmapped = out->normal_remote.minus(low_latency::remote_ranks(rg.view.rank, R, c.nvl_domain));
      if (unmapped.any()) {
        std::string ranks;
        for (int q = 0; q < R; ++q)
          if (unmapped.test(q)) ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
        return ffi_util::Precondition(target_, "ranks [" + ranks + "] of this rank's node (num_max_nvl_peers=" +
                                                   std::to_string(c.nvl_domain) + ") on mesh axis '" + axis_ +
                                                   "' have no load/store mapping, but normal mode forwards through "
                                                   "the node by stores: set num_max_nvl_peers to the GPUs per host");
      }
      out->normal_forward_nvl = c.nvl_domain;
    }
    if (rg.view.peers.base[rg.view.rank] == nullptr)
      return ffi_util::Precondition(target_, "this rank has no staging buffer in the group of mesh axis '" + axis_ + "'");
    return ffi::Error::Success();
  }
  // Every other kernel but the NVSHMEM low-latency ones stores through peer pointers: a rank without one (another
  // host) makes them impossible, which is said here rather than found as a fault.
  if (mode_ != OpMode::kLowLatency || !c.nvshmem) {
    std::string unmapped;
    for (int q = 0; q < R; ++q)
      if (rg.view.peers.base[q] == nullptr) unmapped += (unmapped.empty() ? "" : ", ") + std::to_string(q);
    if (!unmapped.empty())
      return ffi_util::Precondition(
          target_, "ranks [" + unmapped + "] of the group of mesh axis '" + axis_ + "' have no load/store " +
                       "mapping (another host). " +
                       (mode_ == OpMode::kLowLatency
                            ? std::string("Low-latency ops across hosts need the NVSHMEM kernels: set "
                                          "EPConfig.num_max_nvl_peers to the GPUs per host")
                            : std::string("Normal-mode ops across hosts run the NVSHMEM kernels: set "
                                          "EPConfig.num_max_nvl_peers to the GPUs per host")));
  }
  // The NVLink normal-mode send kernel keeps each token's destination rows in registers, kMaxNvlPeers of them.
  if (mode_ == OpMode::kNormal && R > kMaxNvlPeers)
    return ffi_util::Invalid(target_, "normal mode through the NVLink kernels takes at most " +
                                          std::to_string(kMaxNvlPeers) + " ranks, but the group of mesh axis '" +
                                          axis_ + "' has " + std::to_string(R) + ": set EPConfig.num_max_nvl_peers "
                                          "<= " + std::to_string(kMaxNvlPeers) + " (the GPUs per host) so that it "
                                          "runs the NVSHMEM kernels");
  if (mode_ != OpMode::kLowLatency) return ffi::Error::Success();

  const AxisBinding& b = rg.binding;
  if (b.low_latency_bytes <= kLowLatencyFixedBytes)
    return ffi_util::Invalid(target_, "the runtime has no low-latency buffers for mesh axis '" + axis_ +
                                          "' (EPConfig.low_latency_buffers)");
  if (b.low_latency_offset < kSignalHeaderBytes || b.low_latency_offset % kAlign != 0 || b.low_latency_offset + b.low_latency_bytes > rg.view.buffer_bytes)
    return ffi_util::Invalid(target_, "low-latency region [" + std::to_string(b.low_latency_offset) + ", +" +
                                          std::to_string(b.low_latency_bytes) + ") does not fit the group's " +
                                          std::to_string(rg.view.buffer_bytes) + "-byte staging buffer");
  const int64_t half_bytes = low_latency_half_bytes(b.low_latency_bytes);
  if (c.nvshmem && rg.view.pe[rg.view.rank] < 0)
    return ffi_util::Precondition(target_, "the NVSHMEM low-latency kernels (allow_nvlink_for_low_latency=False or "
                                           "R > num_max_nvl_peers) move rows with NVSHMEM puts, but the "
                                           "group of mesh axis '" + axis_ + "' is not an NVSHMEM group: run one "
                                           "process per GPU (python -m jax_ep.launch; one process: "
                                           "JAX_EP_TRANSPORT=nvshmem)");
  const LowLatencyLayout layout = make_low_latency_layout(c.hidden, c.max_tokens_per_rank, c.num_experts, R,
                                                          b.low_latency_offset, half_bytes, c.nvshmem);
  if (layout.half_needed > half_bytes)
    return ffi_util::Invalid(target_, "this config needs " + std::to_string(layout.half_needed) +
                                          " bytes per low-latency half but the runtime has " +
                                          std::to_string(half_bytes) + " (pass this config to jax_ep.initialize)");
  out->low_latency.g = group_ctx(*out);
  out->low_latency.low_latency = layout;
  out->low_latency.num_experts = c.num_experts;
  out->low_latency.num_local = c.num_experts / R;
  out->low_latency.hidden = c.hidden;
  out->low_latency.max_tokens = c.max_tokens_per_rank;
  out->low_latency.sm_count = rg.view.sm_count;
  // Remote: other NVLink domains, and any rank the group has no pointer for (initialize refuses those inside the
  // domain; this keeps the kernels and the registry on one answer whatever nvshmem_ptr says on the device).
  // INVARIANT the NVSHMEM LL kernels rely on: a clear bit implies peers.base[q] != nullptr (their direct_ptr adds
  // an offset to it). Set remote_ranks here only.
  out->low_latency.remote_ranks = RankMask::none();
  if (c.nvshmem) {
    out->low_latency.remote_ranks = low_latency::remote_ranks(rg.view.rank, R, c.nvl_domain);
    for (int q = 0; q < R; ++q)
      if (rg.view.peers.base[q] == nullptr) out->low_latency.remote_ranks.set(q);
  }
  return ffi::Error::Success();
}

ffi::Error OpState::resolve(int32_t ordinal, const Resolved** out) {
  if (ordinal < 0 || ordinal >= kMaxDevices)
    return ffi_util::Invalid(target_, "device ordinal " + std::to_string(ordinal) + " out of range [0, " +
                                          std::to_string(kMaxDevices) + ")");
  std::atomic<const Resolved*>& slot = cache_[ordinal];
  if (const Resolved* hit = slot.load(std::memory_order_acquire);
      hit != nullptr && hit->alive->load(std::memory_order_acquire)) {
    *out = hit;
    return ffi::Error::Success();
  }
  ResolvedGroup rg;
  if (Status st = resolve_axis(axis_, ordinal, &rg); !st.ok())
    return ffi_util::Precondition(target_, st.message());
  auto fresh = std::make_unique<Resolved>();
  if (auto e = validate(rg, fresh.get()); !e.success()) return e;
  const Resolved* published = fresh.get();
  {
    std::lock_guard<std::mutex> lock(mu_);
    owned_.push_back(std::move(fresh));
  }
  slot.store(published, std::memory_order_release);
  *out = published;
  return ffi::Error::Success();
}

}  // namespace jax_ep
