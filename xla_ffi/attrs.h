// The attributes of the group-using targets: one struct per mode, decoded from the call's attribute dictionary by
// XLA (`.Attrs<NormalAttrs>()`), once per call site, in the instantiate stage. Python passes exactly these keyword
// attributes, numpy-typed (a width mismatch or an extra / missing name is a decoding error naming the attribute).
// No group ids and no byte offsets: compiled programs say what, never where (the axis is resolved per device at
// execution through jax_ep/peer_group.h).
#pragma once

#include <cstdint>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace jax_ep {

// The normal-mode targets (registry.h). A program serialized against an older version fails to load with an unknown
// target rather than a missing attribute or a mismatched layout.
struct NormalAttrs {
  std::string_view axis;        // str: the EP mesh axis (bind_axis)
  int32_t num_experts;          // E
  int32_t hidden;               // H
  int32_t num_topk;             // K
  int32_t max_tokens_per_rank;  // T_max
  int32_t num_sms;              // blocks of the NVLink-sending kernels
  int64_t timeout_ns;           // device waits trap after this long
  int32_t nvshmem;                 // 1: the NVSHMEM kernels (EPConfig.normal_over_nvshmem(R))
  int32_t nvl_domain;           // ranks per NVLink domain for those kernels (EPConfig.num_max_nvl_peers)
};

// Every jax_ep_low_latency_*_v6 target.
struct LowLatencyAttrs {
  std::string_view axis;        // str: the EP mesh axis (bind_axis)
  int32_t num_experts;          // E
  int32_t hidden;               // H
  int32_t num_topk;             // K
  int32_t max_tokens_per_rank;  // T_max
  int64_t timeout_ns;           // device waits trap after this long
  int32_t use_fp8;              // dispatch: fp8 (1) or bf16 (0) payload; combine targets: ignored (Python passes 0)
  int32_t per_rank;             // 1: per_rank mode (one message per token and destination rank), 0: per_expert
  int32_t nvshmem;                 // 1: the NVSHMEM kernels (EPConfig.low_latency_over_nvshmem(R))
  int32_t nvl_domain;           // ranks per NVLink domain for those kernels (EPConfig.low_latency_nvl_domain())
};

}  // namespace jax_ep

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::NormalAttrs, StructMember<std::string_view>("axis"),
                                      StructMember<int32_t>("num_experts"), StructMember<int32_t>("hidden"),
                                      StructMember<int32_t>("num_topk"),
                                      StructMember<int32_t>("max_tokens_per_rank"),
                                      StructMember<int32_t>("num_sms"), StructMember<int64_t>("timeout_ns"),
                                      StructMember<int32_t>("nvshmem"), StructMember<int32_t>("nvl_domain"));

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::LowLatencyAttrs, StructMember<std::string_view>("axis"),
                                      StructMember<int32_t>("num_experts"), StructMember<int32_t>("hidden"),
                                      StructMember<int32_t>("num_topk"),
                                      StructMember<int32_t>("max_tokens_per_rank"),
                                      StructMember<int64_t>("timeout_ns"), StructMember<int32_t>("use_fp8"),
                                      StructMember<int32_t>("per_rank"), StructMember<int32_t>("nvshmem"),
                                      StructMember<int32_t>("nvl_domain"));
