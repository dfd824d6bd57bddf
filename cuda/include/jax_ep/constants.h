// Limits the kernels are written for. Handlers validate against these and return an error naming the limit.
#pragma once

namespace jax_ep {

constexpr int kMaxLayoutRanks = 64;        // layout target: the rank mask of a token is one 64-bit word
constexpr int kMaxLayoutExperts = 8192;    // layout target (CUDA): per-expert counters live in shared memory (32 KB)
constexpr int kLayoutThreads = 1024;       // one block computes a layout (T <= 8192 in practice: a few us)
constexpr int kMaxGroupRanks = 8;          // intranode group: peer pointers passed by value in the Params struct
constexpr int kMaxTopk = 16;               // K

}  // namespace jax_ep
