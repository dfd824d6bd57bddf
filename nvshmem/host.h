// NVSHMEM host runtime for the one-process-per-GPU model: bootstrap, teams, symmetric buffers, peer pointers.
//
// Links libnvshmem_host.so.3 and, when the wheel has it, NVSHMEM's device library (libnvshmem_device.a, relocatable
// device code linked into this module: JAX_EP_NVSHMEM_DEVICE=1), so that kernels of this module can call NVSHMEM
// device functions (put-with-signal, signal ops: device/). The kernels of jax_ep._jax_ep_native never call NVSHMEM;
// they get plain load/store peer pointers (nvshmem_ptr) through jax_ep::register_external_group.
//
// Every function validates its arguments and the library state BEFORE calling NVSHMEM, because NVSHMEM reports
// many errors by calling exit(). Errors come back as jax_ep::Status values; nothing here throws or exits.
//
// Collective functions (marked below) must be called by every PE, in the same order; the Python side
// (jax_ep/nvshmem_runtime.py) checks that all processes agree on what they are about to do before calling them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "jax_ep/status.h"

namespace jax_ep {
namespace nvshmem_host {

// Bytes of an NVSHMEM unique id (nvshmemx_uniqueid_t); what travels through the jax.distributed key-value store.
size_t unique_id_bytes();
// NVSHMEM header version this module was compiled against, "major.minor.patch".
std::string header_version();

// PE 0 only, before init: a fresh unique id for the bootstrap.
Status get_unique_id(std::string* out);

// Collective: cudaSetDevice(device_ordinal), then joins the NVSHMEM job as PE `rank` of `nranks` with the unique id
// made by PE 0, and checks nvshmemx_init_status(). Refused after finalize (NVSHMEM 3.x keeps its bootstrap state
// across finalize, so a second init in one process is not a supported path; jax_ep keeps NVSHMEM alive instead).
Status init(int rank, int nranks, const std::string& unique_id, int device_ordinal);
bool initialized();
bool finalized();
int my_pe();    // -1 before init
int n_pes();    // 0 before init
int device_ordinal();  // -1 before init
// Runtime NVSHMEM version after init ("major.minor.patch"), empty before.
std::string runtime_version();

// Collective over the world team (every PE calls it, members or not). *team_out = the new team, or -1
// (NVSHMEM_TEAM_INVALID) on PEs that are not members. PEs start, start + stride, ..., start + (size-1) * stride.
Status team_split_strided(int start, int stride, int size, int32_t* team_out);
Status team_my_pe(int32_t team, int* out);
Status team_n_pes(int32_t team, int* out);
// The PE number in dest_team (world when dest_team == 0) of PE `pe` of `team`; -1 when it is not a member.
Status team_translate_pe(int32_t team, int pe, int32_t dest_team, int* out);
// Collective over the team's members (non-members pass -1, which does nothing).
Status team_destroy(int32_t team);

// Collective: nvshmem_align(4096, bytes) on every PE (same bytes everywhere), zeroed with cudaMemset, then a barrier so
// no peer can see the memory before it is zero. *addr_out = this PE's address of the buffer.
Status malloc_zeroed(size_t bytes, uintptr_t* addr_out);
// nvshmem_ptr: this device's load/store address of `pe`'s copy of the symmetric buffer at `addr` (an address from
// malloc_zeroed, or inside one). *out = 0 when `pe` is not load/store reachable (no NVLink/P2P path).
Status peer_pointer(uintptr_t addr, int pe, uintptr_t* out);
// Collective: waits for this device to go idle and for every PE, then nvshmem_free.
Status free_buffer(uintptr_t addr);
// Collective: nvshmem_barrier_all (also waits for this PE's outstanding NVSHMEM operations).
Status barrier_all();
// Collective: barrier, destroys the teams and frees the buffers still alive, then nvshmemx_hostlib_finalize.
Status finalize();

// Whether this module was built with NVSHMEM's device library (kernels here may call NVSHMEM device functions; init
// then fills their device state). Without it only the host runtime above exists.
bool has_device_library();
// Collective: the device-API check (device/device_check.h) over a scratch symmetric buffer: *out = the
// CheckResult words of this PE (my_pe, n_pes, complete, bad_payloads, bad_counts, first_missing, missing word
// low/high). Each PE's kernel waits at most timeout_s for the others. Error without the device library.
Status device_check(double timeout_s, std::vector<int32_t>* out);
// Test hook (JAX_EP_TEST_COUNT_REMOTE_BYTES=1 before initialize): bytes of low-latency rows this process's device
// put to remote peers since the last reset (device/low_latency.h).
Status remote_put_bytes(bool reset, uint64_t* out);
// Test hook (JAX_EP_TEST_PHASES=1 before initialize): (name, summed ns from a block's start, stamps) per phase of
// the NVSHMEM low-latency kernels since the last reset (device/phase_stamps.cuh).
Status low_latency_phases(bool reset, std::vector<std::string>* names, std::vector<uint64_t>* ns,
                 std::vector<uint64_t>* hits);

// Bytes currently allocated through malloc_zeroed, and the number of live teams made by team_split_strided.
size_t allocated_bytes();
int live_teams();

}  // namespace nvshmem_host
}  // namespace jax_ep
