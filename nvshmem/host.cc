#include "host.h"

#include <cuda_runtime_api.h>
#include <nvshmem.h>
#include <nvshmemx.h>

#include <cstring>
#include <algorithm>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#if JAX_EP_NVSHMEM_DEVICE
#include "device/device_check.h"
#include "device/low_latency.h"
#include "device/normal.h"
#endif

namespace jax_ep {
namespace nvshmem_host {
namespace {

// NVSHMEM is a process-wide singleton; so is this mirror of what we did with it. Every entry point holds the mutex
// for its whole duration: NVSHMEM's host API is initialized NVSHMEM_THREAD_SERIALIZED by the hostlib init.
struct State {
  std::mutex mu;
  bool initialized = false;
  bool finalized = false;
  int my_pe = -1;
  int n_pes = 0;
  int device = -1;
  // NOTE: creation order, the same on every PE: finalize frees / destroys in that order, as collectives require.
  std::vector<std::pair<uintptr_t, size_t>> buffers;  // (base address, bytes) from malloc_zeroed
  std::vector<int32_t> teams;                         // teams this PE is a member of, from team_split_strided
};

State& state() {
  static State s;
  return s;
}

// Symmetric buffers start on a page: jax_ep's staging layout aligns its regions to 256 bytes from the base.
constexpr size_t kBufferAlign = 4096;

Status need_initialized(const State& s, const char* what) {
  if (s.finalized) return Status::Error(std::string(what) + ": NVSHMEM was already finalized in this process");
  if (!s.initialized) return Status::Error(std::string(what) + ": NVSHMEM is not initialized (call init first)");
  return Status::Ok();
}

// NOTE: our cudart (static, private to this module) keeps its own current device per thread; callers may come from
// any Python thread, so every CUDA call site re-selects the device NVSHMEM was initialized on.
Status select_device(const State& s) {
  return CudaStatus(cudaSetDevice(s.device), "cudaSetDevice", __FILE__, __LINE__);
}

Status known_team(const State& s, int32_t team, const char* what) {
  if (team == NVSHMEM_TEAM_WORLD || std::find(s.teams.begin(), s.teams.end(), team) != s.teams.end())
    return Status::Ok();
  return Status::Error(std::string(what) + ": team " + std::to_string(team) +
                       " is not a live team of this PE (world = 0, or a handle from team_split_strided that was not "
                       "destroyed)");
}

}  // namespace

size_t unique_id_bytes() { return sizeof(nvshmemx_uniqueid_t); }

std::string header_version() {
  return std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." + std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}

Status get_unique_id(std::string* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.initialized || s.finalized)
    return Status::Error("get_unique_id: only before init (PE 0 makes the id that every PE passes to init)");
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  const int rc = nvshmemx_get_uniqueid(&id);
  if (rc != 0) return Status::Error("nvshmemx_get_uniqueid failed with status " + std::to_string(rc));
  out->assign(reinterpret_cast<const char*>(&id), sizeof(id));
  return Status::Ok();
}

Status init(int rank, int nranks, const std::string& unique_id, int device_ordinal) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.finalized)
    return Status::Error("init: NVSHMEM was finalized in this process and cannot be initialized again "
                         "(NVSHMEM 3.x keeps its bootstrap state across finalize)");
  if (s.initialized) {
    if (rank == s.my_pe && nranks == s.n_pes && device_ordinal == s.device) return Status::Ok();
    return Status::Error("init: NVSHMEM is already initialized as PE " + std::to_string(s.my_pe) + " of " +
                         std::to_string(s.n_pes) + " on device " + std::to_string(s.device) + "; asked for PE " +
                         std::to_string(rank) + " of " + std::to_string(nranks) + " on device " +
                         std::to_string(device_ordinal));
  }
  if (nranks < 1) return Status::Error("init: nranks must be >= 1, got " + std::to_string(nranks));
  if (rank < 0 || rank >= nranks)
    return Status::Error("init: rank must be in [0, " + std::to_string(nranks) + "), got " + std::to_string(rank));
  if (unique_id.size() != sizeof(nvshmemx_uniqueid_t))
    return Status::Error("init: unique_id must be " + std::to_string(sizeof(nvshmemx_uniqueid_t)) +
                         " bytes (from get_unique_id on PE 0), got " + std::to_string(unique_id.size()));
  int count = 0;
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count));
  if (device_ordinal < 0 || device_ordinal >= count)
    return Status::Error("init: device_ordinal " + std::to_string(device_ordinal) + " out of range (" +
                         std::to_string(count) + " CUDA devices visible)");
  // NVSHMEM binds the PE to the device current at init (it takes the primary context, which XLA uses too).
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_ordinal));
  JAX_EP_CUDA_RETURN_IF_ERROR(cudaFree(nullptr));  // make the primary context current on this thread

  nvshmemx_uniqueid_t id;
  std::memcpy(&id, unique_id.data(), sizeof(id));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  int rc = nvshmemx_set_attr_uniqueid_args(rank, nranks, &id, &attr);
  if (rc != 0) return Status::Error("nvshmemx_set_attr_uniqueid_args failed with status " + std::to_string(rc));
#if JAX_EP_NVSHMEM_DEVICE
  // NOTE: what the header's inline nvshmemx_init_attr does, minus its exit() on failure: nvshmemi_init_thread (in
  // the device library linked into THIS module) initializes the host library and fills this module's device state
  // (nvshmemi_device_state_d), which the kernels of this module read on every NVSHMEM device call. An init from
  // another binary would leave that state empty here.
  int provided = 0;
  const nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                      NVSHMEM_VENDOR_PATCH_VERSION};
  rc = nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version);
  if (rc != 0) return Status::Error("nvshmemi_init_thread (nvshmemx_init_attr) failed with status " + std::to_string(rc));
#else
  // NOTE: the host-library init (what nvshmem4py uses): without the device library (not in this build) there is
  // no device state to fill, and the header's inline nvshmemx_init_attr would not link.
  rc = nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr);
  if (rc != 0) return Status::Error("nvshmemx_hostlib_init_attr failed with status " + std::to_string(rc));
#endif
  const int st = nvshmemx_init_status();
  if (st < NVSHMEM_STATUS_IS_INITIALIZED)
    return Status::Error("NVSHMEM init returned but nvshmemx_init_status() is " + std::to_string(st) +
                         " (expected >= NVSHMEM_STATUS_IS_INITIALIZED = " +
                         std::to_string(int{NVSHMEM_STATUS_IS_INITIALIZED}) + ")");
  const int pe = nvshmem_my_pe(), npes = nvshmem_n_pes();
  if (pe != rank || npes != nranks)
    return Status::Error("NVSHMEM init made this process PE " + std::to_string(pe) + " of " + std::to_string(npes) +
                         ", expected " + std::to_string(rank) + " of " + std::to_string(nranks));
  s.initialized = true;
  s.my_pe = pe;
  s.n_pes = npes;
  s.device = device_ordinal;
  return Status::Ok();
}

bool initialized() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.initialized;
}
bool finalized() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.finalized;
}
int my_pe() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.my_pe;
}
int n_pes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.n_pes;
}
int device_ordinal() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.device;
}

std::string runtime_version() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.initialized) return "";
  int major = 0, minor = 0, patch = 0;
  nvshmemx_vendor_get_version_info(&major, &minor, &patch);
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

Status team_split_strided(int start, int stride, int size, int32_t* team_out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "team_split_strided"));
  const std::string args = "(start " + std::to_string(start) + ", stride " + std::to_string(stride) + ", size " +
                           std::to_string(size) + ")";
  if (size < 1) return Status::Error("team_split_strided: size must be >= 1 " + args);
  if (stride < 1) return Status::Error("team_split_strided: stride must be >= 1 " + args);
  if (start < 0 || static_cast<int64_t>(start) + static_cast<int64_t>(size - 1) * stride >= s.n_pes)
    return Status::Error("team_split_strided: PEs out of range for a world of " + std::to_string(s.n_pes) + " " +
                         args);
  // NOTE: the number of teams against NVSHMEM_MAX_TEAMS is checked by the caller on the whole plan (the same answer
  // on every PE); a check here could refuse on one PE only and leave the others waiting in the split.
  nvshmem_team_t team = NVSHMEM_TEAM_INVALID;
  const int rc = nvshmem_team_split_strided(NVSHMEM_TEAM_WORLD, start, stride, size, nullptr, 0, &team);
  if (rc != 0) return Status::Error("nvshmem_team_split_strided" + args + " failed with status " + std::to_string(rc));
  if (team != NVSHMEM_TEAM_INVALID) s.teams.push_back(team);
  *team_out = team;
  return Status::Ok();
}

Status team_my_pe(int32_t team, int* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "team_my_pe"));
  JAX_EP_RETURN_IF_ERROR(known_team(s, team, "team_my_pe"));
  *out = nvshmem_team_my_pe(team);
  return Status::Ok();
}

Status team_n_pes(int32_t team, int* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "team_n_pes"));
  JAX_EP_RETURN_IF_ERROR(known_team(s, team, "team_n_pes"));
  *out = nvshmem_team_n_pes(team);
  return Status::Ok();
}

Status team_translate_pe(int32_t team, int pe, int32_t dest_team, int* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "team_translate_pe"));
  JAX_EP_RETURN_IF_ERROR(known_team(s, team, "team_translate_pe"));
  JAX_EP_RETURN_IF_ERROR(known_team(s, dest_team, "team_translate_pe"));
  const int n = nvshmem_team_n_pes(team);
  if (pe < 0 || pe >= n)
    return Status::Error("team_translate_pe: pe must be in [0, " + std::to_string(n) + ") for team " +
                         std::to_string(team) + ", got " + std::to_string(pe));
  *out = nvshmem_team_translate_pe(team, pe, dest_team);
  return Status::Ok();
}

Status team_destroy(int32_t team) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "team_destroy"));
  if (team == NVSHMEM_TEAM_INVALID) return Status::Ok();  // this PE was not a member
  if (team == NVSHMEM_TEAM_WORLD) return Status::Error("team_destroy: the world team cannot be destroyed");
  JAX_EP_RETURN_IF_ERROR(known_team(s, team, "team_destroy"));
  nvshmem_team_destroy(team);
  s.teams.erase(std::find(s.teams.begin(), s.teams.end(), team));
  return Status::Ok();
}

Status malloc_zeroed(size_t bytes, uintptr_t* addr_out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "malloc"));
  if (bytes == 0) return Status::Error("malloc: bytes must be > 0");
  JAX_EP_RETURN_IF_ERROR(select_device(s));
  void* p = nvshmem_align(kBufferAlign, bytes);
  if (p == nullptr)
    return Status::Error("nvshmem_align(" + std::to_string(kBufferAlign) + ", " + std::to_string(bytes) +
                         ") returned null: the symmetric heap is too small (NVSHMEM_SYMMETRIC_SIZE, fixed at init) "
                         "or the device is out of memory (XLA preallocates 75% of GPU memory unless "
                         "XLA_PYTHON_CLIENT_PREALLOCATE=false)");
  // NOTE: zeroed once here; jax_ep's counters only grow afterwards (see cuda/transport/peer_group.cc). The barrier
  // makes every PE's memset complete before any peer can write into this buffer.
  Status st = CudaStatus(cudaMemset(p, 0, bytes), "cudaMemset", __FILE__, __LINE__);
  if (st.ok()) st = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  nvshmem_barrier_all();  // collective: every PE reaches it whatever happened to its memset
  if (!st.ok()) {
    nvshmem_free(p);
    return st;
  }
  s.buffers.emplace_back(reinterpret_cast<uintptr_t>(p), bytes);
  *addr_out = reinterpret_cast<uintptr_t>(p);
  return Status::Ok();
}

Status peer_pointer(uintptr_t addr, int pe, uintptr_t* out) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "ptr"));
  if (pe < 0 || pe >= s.n_pes)
    return Status::Error("ptr: pe must be in [0, " + std::to_string(s.n_pes) + "), got " + std::to_string(pe));
  const bool inside = std::any_of(s.buffers.begin(), s.buffers.end(), [addr](const auto& b) {
    return addr >= b.first && addr < b.first + b.second;
  });
  if (!inside)
    return Status::Error("ptr: address " + std::to_string(addr) + " is not inside a live symmetric buffer");
  *out = reinterpret_cast<uintptr_t>(nvshmem_ptr(reinterpret_cast<const void*>(addr), pe));
  return Status::Ok();
}

Status free_buffer(uintptr_t addr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "free"));
  auto it = std::find_if(s.buffers.begin(), s.buffers.end(), [addr](const auto& b) { return b.first == addr; });
  if (it == s.buffers.end())
    return Status::Error("free: address " + std::to_string(addr) + " is not a live buffer from malloc");
  JAX_EP_RETURN_IF_ERROR(select_device(s));
  // No kernel of this process may still touch the buffer; the barrier extends that to every PE.
  const Status st = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  nvshmem_barrier_all();
  nvshmem_free(reinterpret_cast<void*>(addr));
  s.buffers.erase(it);
  return st;
}

Status barrier_all() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "barrier_all"));
  JAX_EP_RETURN_IF_ERROR(select_device(s));
  nvshmem_barrier_all();
  return Status::Ok();
}

Status finalize() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.finalized || !s.initialized) return Status::Ok();
  JAX_EP_RETURN_IF_ERROR(select_device(s));
  const Status st = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  nvshmem_barrier_all();
  for (int32_t team : s.teams) nvshmem_team_destroy(team);
  s.teams.clear();
  for (auto& [addr, bytes] : s.buffers) nvshmem_free(reinterpret_cast<void*>(addr));
  s.buffers.clear();
#if JAX_EP_NVSHMEM_DEVICE
  nvshmem_finalize();  // clears this module's device state, then the host library
#else
  nvshmemx_hostlib_finalize();
#endif
  s.initialized = false;
  s.finalized = true;
  return st;
}

bool has_device_library() { return JAX_EP_NVSHMEM_DEVICE != 0; }

Status remote_put_bytes(bool reset, uint64_t* out) {
#if JAX_EP_NVSHMEM_DEVICE
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "remote_put_bytes"));
  JAX_EP_RETURN_IF_ERROR(select_device(s));
  return nvshmem::remote_put_bytes(reset, out);
#else
  (void)reset;
  (void)out;
  return Status::Error("remote_put_bytes: this jax_ep._jax_ep_nvshmem was built without NVSHMEM's device library");
#endif
}

Status low_latency_phases(bool reset, std::vector<std::string>* names, std::vector<uint64_t>* ns,
                 std::vector<uint64_t>* hits) {
#if JAX_EP_NVSHMEM_DEVICE
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "low_latency_phases"));
  JAX_EP_RETURN_IF_ERROR(select_device(s));
  JAX_EP_RETURN_IF_ERROR(nvshmem::low_latency_phases(reset, ns, hits));
  const char* const* n = nvshmem::low_latency_phase_names();
  names->assign(n, n + ns->size());
  return Status::Ok();
#else
  (void)reset;
  (void)names;
  (void)ns;
  (void)hits;
  return Status::Error("low_latency_phases: this jax_ep._jax_ep_nvshmem was built without NVSHMEM's device library");
#endif
}

Status device_check(double timeout_s, std::vector<int32_t>* out) {
#if JAX_EP_NVSHMEM_DEVICE
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  JAX_EP_RETURN_IF_ERROR(need_initialized(s, "device_check"));
  if (!(timeout_s > 0.0)) return Status::Error("device_check: timeout_s must be > 0");
  JAX_EP_RETURN_IF_ERROR(select_device(s));
  const size_t bytes = nvshmem::check_buffer_bytes(s.n_pes);
  char* buf = static_cast<char*>(nvshmem_align(kBufferAlign, bytes));
  if (buf == nullptr) return Status::Error("device_check: nvshmem_align(" + std::to_string(bytes) + ") returned null");
  nvshmem::CheckResult* result = nullptr;
  cudaStream_t stream = nullptr;
  Status st = CudaStatus(cudaMalloc(&result, sizeof(nvshmem::CheckResult)), "cudaMalloc", __FILE__, __LINE__);
  if (st.ok()) st = CudaStatus(cudaMemset(buf, 0, bytes), "cudaMemset", __FILE__, __LINE__);
  if (st.ok()) st = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate",
                               __FILE__, __LINE__);
  if (st.ok()) st = CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize", __FILE__, __LINE__);
  // NOTE: every PE reaches both barriers whatever failed locally (collectives); the kernel's waits are bounded, so
  // a PE whose kernel did not run makes the others report it missing instead of hanging them.
  nvshmem_barrier_all();  // every PE's buffer is zero before any PE's kernel writes into it
  nvshmem::CheckResult host{};
  if (st.ok())
    st = nvshmem::launch_device_check(buf, s.n_pes, static_cast<uint64_t>(timeout_s * 1e9), result, stream);
  if (st.ok()) st = CudaStatus(cudaStreamSynchronize(stream), "device check kernel", __FILE__, __LINE__);
  if (st.ok())
    st = CudaStatus(cudaMemcpy(&host, result, sizeof(host), cudaMemcpyDeviceToHost), "cudaMemcpy", __FILE__,
                    __LINE__);
  nvshmem_barrier_all();  // no PE frees the buffer while another still reads or writes it
  nvshmem_free(buf);
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (result != nullptr) cudaFree(result);
  JAX_EP_RETURN_IF_ERROR(st);
  const int32_t* words = reinterpret_cast<const int32_t*>(&host);
  out->assign(words, words + nvshmem::CheckResult::kWords);
  // part of the prewarm: the low-latency kernels are loaded now (this device is current), not at the first call
  JAX_EP_RETURN_IF_ERROR(nvshmem::preload_kernels());
  return nvshmem::preload_normal_kernels();
#else
  (void)timeout_s;
  (void)out;
  return Status::Error("device_check: this jax_ep._jax_ep_nvshmem was built without NVSHMEM's device library "
                       "(lib/libnvshmem_device.a of the nvidia-nvshmem-cu13 wheel)");
#endif
}

size_t allocated_bytes() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  size_t total = 0;
  for (auto& [addr, bytes] : s.buffers) total += bytes;
  return total;
}

int live_teams() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return static_cast<int>(s.teams.size());
}

}  // namespace nvshmem_host
}  // namespace jax_ep
