// The nanobind module jax_ep._jax_ep_nvshmem: NVSHMEM's host runtime for the one-process-per-GPU model.
//
// Loaded lazily by jax_ep/nvshmem_runtime.py, only when a multi-process program initializes the CUDA backend, so
// `import jax_ep` never loads libnvshmem_host.so.3. Thin bindings over nvshmem/host.h: errors become RuntimeError
// with the message of the failed check; collective calls release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "host.h"

#if JAX_EP_NVSHMEM_DEVICE
#include "device/low_latency.h"
#include "device/normal.h"
#endif

namespace nb = nanobind;
namespace nh = jax_ep::nvshmem_host;

namespace {

void throw_if_error(const jax_ep::Status& st) {
  if (!st.ok()) throw std::runtime_error(st.message());
}

// Runs a collective (or otherwise blocking) call without the GIL: other Python threads keep running while this
// PE waits for its peers.
template <typename F>
void blocking(F&& f) {
  jax_ep::Status st;
  {
    nb::gil_scoped_release release;
    st = f();
  }
  throw_if_error(st);
}

}  // namespace

NB_MODULE(_jax_ep_nvshmem, m) {
  m.doc() = "jax_ep NVSHMEM host runtime (one process per GPU): bootstrap, teams, symmetric buffers";

  m.def("unique_id_bytes", &nh::unique_id_bytes, "bytes of an NVSHMEM unique id");
  m.def("header_version", &nh::header_version, "NVSHMEM version of the headers this module was built against");
  m.def("runtime_version", &nh::runtime_version, "NVSHMEM version running (after init; '' before)");
  m.def(
      "get_unique_id",
      []() {
        std::string id;
        throw_if_error(nh::get_unique_id(&id));
        return nb::bytes(id.data(), id.size());
      },
      "PE 0, before init: a fresh unique id (bytes) for the bootstrap");
  m.def(
      "init",
      [](int rank, int nranks, nb::bytes unique_id, int device_ordinal) {
        std::string id(unique_id.c_str(), unique_id.size());
        blocking([&] { return nh::init(rank, nranks, id, device_ordinal); });
      },
      nb::arg("rank"), nb::arg("nranks"), nb::arg("unique_id"), nb::arg("device_ordinal"),
      "Collective: joins the NVSHMEM job as PE rank of nranks on CUDA device device_ordinal");
  m.def("initialized", &nh::initialized);
  m.def("finalized", &nh::finalized);
  m.def("my_pe", &nh::my_pe);
  m.def("n_pes", &nh::n_pes);
  m.def("device_ordinal", &nh::device_ordinal);
  m.def(
      "team_split_strided",
      [](int start, int stride, int size) -> nb::object {
        int32_t team = -1;
        blocking([&] { return nh::team_split_strided(start, stride, size, &team); });
        if (team < 0) return nb::none();
        return nb::int_(team);
      },
      nb::arg("start"), nb::arg("stride"), nb::arg("size"),
      "Collective over the world (every PE calls it, in the same order): a team of world PEs start, start+stride, "
      "...; returns its handle, or None on PEs that are not members");
  m.def(
      "team_my_pe",
      [](int32_t team) {
        int out = -1;
        throw_if_error(nh::team_my_pe(team, &out));
        return out;
      },
      nb::arg("team"));
  m.def(
      "team_n_pes",
      [](int32_t team) {
        int out = -1;
        throw_if_error(nh::team_n_pes(team, &out));
        return out;
      },
      nb::arg("team"));
  m.def(
      "team_translate_pe",
      [](int32_t team, int pe, int32_t dest_team) {
        int out = -1;
        throw_if_error(nh::team_translate_pe(team, pe, dest_team, &out));
        return out;
      },
      nb::arg("team"), nb::arg("pe"), nb::arg("dest_team") = 0,
      "PE number in dest_team (default: world) of PE pe of team; -1 when it is not a member");
  m.def(
      "team_destroy", [](int32_t team) { blocking([&] { return nh::team_destroy(team); }); }, nb::arg("team"),
      "Collective over the team's members");
  m.def(
      "malloc",
      [](size_t bytes) {
        uintptr_t addr = 0;
        blocking([&] { return nh::malloc_zeroed(bytes, &addr); });
        return addr;
      },
      nb::arg("bytes"), "Collective: nvshmem_malloc, zeroed, then a barrier; returns this PE's device address");
  m.def(
      "ptr",
      [](uintptr_t addr, int pe) {
        uintptr_t out = 0;
        throw_if_error(nh::peer_pointer(addr, pe, &out));
        return out;
      },
      nb::arg("addr"), nb::arg("pe"),
      "nvshmem_ptr: this device's address of PE pe's copy of a symmetric buffer (0: not load/store reachable)");
  m.def(
      "free", [](uintptr_t addr) { blocking([&] { return nh::free_buffer(addr); }); }, nb::arg("addr"),
      "Collective: device idle, barrier, nvshmem_free");
  m.def("barrier_all", []() { blocking([] { return nh::barrier_all(); }); }, "Collective: nvshmem_barrier_all");
  m.def(
      "finalize", []() { blocking([] { return nh::finalize(); }); },
      "Collective: destroys live teams, frees live buffers, finalizes NVSHMEM (no init afterwards in this process)");
  m.def("has_device_library", &nh::has_device_library,
        "whether this module holds NVSHMEM's device library (device-side puts and signals)");
  m.def(
      "device_check",
      [](double timeout_s) {
        std::vector<int32_t> w;
        blocking([&] { return nh::device_check(timeout_s, &w); });
        nb::dict d;
        const char* names[] = {"my_pe", "n_pes", "complete", "bad_payloads", "bad_counts", "first_missing",
                               "missing_low", "missing_high"};
        for (size_t i = 0; i < w.size(); ++i) d[names[i]] = w[i];
        return d;
      },
      nb::arg("timeout_s"),
      "Collective: every PE sends counted put-with-signal messages to every PE from a kernel and checks what it "
      "received (dict of what this PE saw; complete == n_pes and zero bad counts/payloads when all is well)");
  m.def(
      "test_remote_put_bytes",
      [](bool reset) {
        uint64_t bytes = 0;
        blocking([&] { return nh::remote_put_bytes(reset, &bytes); });
        return bytes;
      },
      nb::arg("reset") = false,
      "Test hook: bytes of low-latency rows this device put to remote peers (NVSHMEM puts) since the last reset; "
      "counted only when JAX_EP_TEST_COUNT_REMOTE_BYTES=1 was set before initialize");
  m.def(
      "test_low_latency_phases",
      [](bool reset) {
        std::vector<std::string> names;
        std::vector<uint64_t> ns, hits;
        blocking([&] { return nh::low_latency_phases(reset, &names, &ns, &hits); });
        nb::list out;
        for (size_t i = 0; i < names.size(); ++i) out.append(nb::make_tuple(names[i], ns[i], hits[i]));
        return out;
      },
      nb::arg("reset") = false,
      "Test hook: [(phase, summed ns from a block's start, stamps)] of the NVSHMEM low-latency kernels since the last "
      "reset; stamped only when JAX_EP_TEST_PHASES=1 was set before initialize (nvshmem/device/phase_stamps.cuh)");
  m.def(
      "low_latency_nvshmem_ops",
      []() -> nb::object {
#if JAX_EP_NVSHMEM_DEVICE
        return nb::capsule(const_cast<jax_ep::LowLatencyNvshmemOps*>(jax_ep::nvshmem::low_latency_ops()),
                           "jax_ep.LowLatencyNvshmemOps");
#else
        return nb::none();
#endif
      },
      "The NVSHMEM low-latency kernels of this module as a capsule for jax_ep._jax_ep_native."
      "set_low_latency_nvshmem_ops (None without the device library)");
  m.def(
      "normal_nvshmem_ops",
      []() -> nb::object {
#if JAX_EP_NVSHMEM_DEVICE
        return nb::capsule(const_cast<jax_ep::NormalNvshmemOps*>(jax_ep::nvshmem::normal_ops()), "jax_ep.NormalNvshmemOps");
#else
        return nb::none();
#endif
      },
      "The NVSHMEM normal-mode kernels of this module as a capsule for jax_ep._jax_ep_native.set_normal_nvshmem_ops "
      "(None without the device library)");
  m.def("allocated_bytes", &nh::allocated_bytes);
  m.def("live_teams", &nh::live_teams);
}
