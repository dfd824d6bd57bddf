// The per-call-site state of every group-using target (XLA FFI state, instantiate stage).
//
//   instantiate  (once per call site per executable, at compile / deserialize time, no device): decodes the struct
//                attributes, validates what does not depend on the group, and keeps the config + the axis name.
//   execute      (every call, one host thread per device): resolve() turns (axis, DeviceOrdinal) into the group view
//                and the low-latency context, cached per device ordinal while the group it names is alive: a hit
//                is two atomic loads (no lock, no map walk); a miss re-resolves under the registry's shared lock
//                (the first call, or after a finalize).
// INVARIANT (pinning): a call site keeps the group it first resolved for as long as that group exists (a group
// destroyed elsewhere, e.g. by a failed initialize cleaning up groups it never bound, changes nothing here).
// A later initialize with more configs binds the axis to new groups and retires the old ones (alive until
// finalize); a program that ran before keeps the old buffers on EVERY device, whether XLA replays it from a
// CUDA graph (handlers not called: the graph holds the old pointers) or calls the handlers (they must agree with
// the graph-replaying devices and processes, or the ranks wait on different buffers and deadlock). Programs first run after the initialize use the new groups.
// NOTE: one state is shared by all devices that run the executable (single process, N GPUs): each device reads and
// writes only its own cache slot. Published resolutions are immutable and live as long as the state, so a thread
// that loaded a pointer can keep using it while another call of the same device republishes.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "attrs.h"
#include "jax_ep/low_latency_params.h"
#include "jax_ep/peer_group.h"
#include "xla/ffi/api/ffi.h"

namespace jax_ep {

enum class OpMode : int32_t { kNormal = 0, kLowLatency = 1 };

// The decoded attributes of a call site (the axis name is kept by the state).
struct OpConfig {
  int32_t num_experts = 0, hidden = 0, num_topk = 0, max_tokens_per_rank = 0;
  int32_t num_sms = 0;     // normal mode
  bool use_fp8 = false;    // low-latency dispatch
  bool per_rank = false;   // low-latency mode: per_rank (EPConfig.low_latency_mode)
  // the NVSHMEM kernels: EPConfig.low_latency_over_nvshmem(R) (low-latency), EPConfig.normal_over_nvshmem(R) (normal)
  bool nvshmem = false;
  int32_t nvl_domain = 0;  // with nvshmem: ranks r, q with r / nvl_domain == q / nvl_domain are reached by stores
  uint64_t timeout_ns = 1;
};

// One device's resolution of a call site (immutable once published).
struct Resolved {
  std::shared_ptr<const std::atomic<bool>> alive;  // its group's liveness (ResolvedGroup::alive)
  GroupDeviceView view;
  AxisBinding binding;
  int64_t normal_limit = 0;  // bytes the normal-mode layout may use: [0, low_latency_offset) when an LL region is bound
  RankMask normal_remote = RankMask::none();  // normal targets with nvshmem: GroupCtx::remote
  int32_t normal_forward_nvl = 0;  // normal targets with nvshmem: GroupCtx::forward_nvl (hierarchical dispatch)
  low_latency::Ctx low_latency{};              // low-latency targets: the validated context (group, layout of the bound region)
};

class OpState {
 public:
  static ::xla::ffi::TypeId id;  // set by jax.ffi.register_ffi_type (module.cc: state_types())

  static ::xla::ffi::ErrorOr<std::unique_ptr<OpState>> Normal(const char* target, const NormalAttrs& a);
  static ::xla::ffi::ErrorOr<std::unique_ptr<OpState>> LowLatency(const char* target, const LowLatencyAttrs& a);

  // This call site on device `ordinal`: the group and region of the bound axis, validated for this config.
  ::xla::ffi::Error resolve(int32_t ordinal, const Resolved** out);

  const char* target() const { return target_; }
  const OpConfig& config() const { return config_; }
  GroupCtx group_ctx(const Resolved& r) const;  // peers, rank, R, timeout (layout left empty)

 private:
  static constexpr int kMaxDevices = 64;  // local CUDA ordinals

  OpState(const char* target, OpMode mode, std::string axis, const OpConfig& config)
      : target_(target), mode_(mode), axis_(std::move(axis)), config_(config) {}
  ::xla::ffi::Error validate(const ResolvedGroup& rg, Resolved* out) const;

  const char* target_;  // a string literal: names the target in every error
  OpMode mode_;
  std::string axis_;
  OpConfig config_;
  std::array<std::atomic<const Resolved*>, kMaxDevices> cache_{};
  std::mutex mu_;                                  // guards owned_
  std::vector<std::unique_ptr<const Resolved>> owned_;
};

}  // namespace jax_ep
