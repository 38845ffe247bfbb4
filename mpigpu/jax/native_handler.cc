// mpigpu's compiled XLA FFI handler: the one-device collectives of mpigpu.jax without Python.
//
// The Python handler (mpigpu/jax/_handler.py) costs ~120 us of CPU per call (ctypes, the GIL, the
// decoding); this one calls NCCL (GPU) or MPI (CPU) directly. It knows no library at build time: the
// Python side registers, per compiled call, a "slot" holding the function to call (ncclAllReduce,
// MPI_Allreduce, ... as loaded in this process), the communicator and the datatype/op values, and the
// compiled program names the slot by a small integer attribute. A slot is registered while the program
// is lowered, in this process, so a program never names a pointer from another process.
//
// Same bits as mpigpu's eager call: the Python side registers only the calls whose eager path is the
// one plain library call (NCCL's ncclAvg included; on CPU MPI_Allreduce, then avg's IEEE division by
// the rank count and every NaN made the canonical one, as mpigpu.backends.cpu does).
//
// Per-device slots (a call once per device inside jax.shard_map, nccl path): the slot holds one NCCL
// communicator per local GPU (mpigpu.multi's DeviceComms) with the CUDA ordinal of each, and XLA calls the
// handler once per device, on that device's thread and stream; the call picks its GPU's communicator by
// XLA's device ordinal (the mapping of mpigpu.jax._devices.position, checked for every device when lowered).
//
// Build: c++ -std=c++17 -O2 -shared -fPIC -I<jax.ffi.include_dir()> (mpigpu.jax._native does it,
// once per machine, into the private kernel cache).

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <time.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

enum Kind : int32_t { kEmpty = 0, kNccl = 1, kMpi = 2 };
enum Collective : int32_t { kAllreduce = 0, kBroadcast = 1, kAllgather = 2 };
enum After : int32_t { kNothing = 0, kCanonF32 = 1, kCanonF64 = 2, kAvgF32 = 3, kAvgF64 = 4 };
constexpr int kMaxDevices = 16;  // mpigpu.jax._native.MAX_DEVICES

// One compiled call's fixed arguments. Mirrored by mpigpu.jax._native.Slot (ctypes): keep the two equal.
struct Slot {
  int32_t kind;
  int32_t collective;
  int32_t handle_bytes;  // MPI: the width of its handles (4: MPICH's ints, 8: Open MPI's pointers)
  int32_t root;          // broadcast's root
  int64_t datatype;      // allreduce: ncclDataType_t or the MPI_Datatype handle; else the byte type's
  int64_t op;            // ncclRedOp_t, or the MPI_Op handle
  int64_t comm;          // ncclComm_t, or the MPI_Comm handle
  int64_t fn;            // the library function (broadcast and allgather move bytes)
  int32_t nranks;
  int32_t after;         // After: what runs on the host after MPI (CPU only)
  int32_t devices;       // per-device slot: how many local GPUs (0: one device per process, ``comm``)
  int32_t ordinals[kMaxDevices];  // per-device slot: the CUDA ordinal of each local GPU, by position
  int64_t comms[kMaxDevices];     // per-device slot: that GPU's ncclComm_t
};

constexpr int kSlots = 4096;
Slot slots[kSlots];
std::mutex slots_lock;  // registration (rare) against reading a slot (every call)
std::mutex call_lock;   // one collective at a time per process, as the Python handler's lock
// what runs now, for mpigpu's watchdog (it samples these from its own thread): the slot (-1: none) and
// a serial number that changes with every call
std::atomic<int64_t> busy_slot{-1};
std::atomic<int64_t> busy_serial{0};

// the handler's own cost, while mpigpu_native_record(1) is on (benchmarks): calls, wall and CPU nanoseconds
std::atomic<bool> timing{false};
std::atomic<int64_t> timed_calls{0}, timed_wall_ns{0}, timed_cpu_ns{0};

int64_t Nanoseconds(clockid_t clock) {
  timespec t;
  clock_gettime(clock, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

struct Busy {
  explicit Busy(int64_t index) : timed(timing.load(std::memory_order_relaxed)) {
    busy_serial.fetch_add(1, std::memory_order_relaxed);
    busy_slot.store(index, std::memory_order_release);
    if (timed) {
      wall = Nanoseconds(CLOCK_MONOTONIC);
      cpu = Nanoseconds(CLOCK_THREAD_CPUTIME_ID);
    }
  }
  ~Busy() {
    busy_slot.store(-1, std::memory_order_release);
    if (timed) {
      timed_wall_ns.fetch_add(Nanoseconds(CLOCK_MONOTONIC) - wall, std::memory_order_relaxed);
      timed_cpu_ns.fetch_add(Nanoseconds(CLOCK_THREAD_CPUTIME_ID) - cpu, std::memory_order_relaxed);
      timed_calls.fetch_add(1, std::memory_order_relaxed);
    }
  }
  bool timed;
  int64_t wall = 0, cpu = 0;
};

using NcclAllReduce = int (*)(const void*, void*, size_t, int, int, void*, void*);
using NcclBroadcast = int (*)(const void*, void*, size_t, int, int, void*, void*);
using NcclAllGather = int (*)(const void*, void*, size_t, int, void*, void*);

template <typename H>
int MpiCall(const Slot& s, const void* x, void* out, int count, int bytes) {
  using Allreduce = int (*)(const void*, void*, int, H, H, H);
  using Bcast = int (*)(void*, int, H, int, H);
  using Allgather = int (*)(const void*, int, H, void*, int, H, H);
  auto handle = [](int64_t v) { return (H)(intptr_t)v; };
  switch (s.collective) {
    case kAllreduce:
      return ((Allreduce)s.fn)(x, out, count, handle(s.datatype), handle(s.op), handle(s.comm));
    case kBroadcast:
      if (out != x) std::memcpy(out, x, bytes);
      return ((Bcast)s.fn)(out, bytes, handle(s.datatype), s.root, handle(s.comm));
    default:
      return ((Allgather)s.fn)(x, bytes, handle(s.datatype), out, bytes, handle(s.datatype), handle(s.comm));
  }
}

template <typename F, typename U>
void Finish(F* values, size_t n, int32_t nranks, bool divide, U canonical) {
  const F d = static_cast<F>(nranks);
  for (size_t i = 0; i < n; ++i) {
    F v = values[i];
    if (divide) v = v / d;
    if (v != v) std::memcpy(&v, &canonical, sizeof v);
    values[i] = v;
  }
}

ffi::Error Lookup(int64_t index, Slot* found) {
  if (index < 0 || index >= kSlots) return ffi::Error::InvalidArgument("mpigpu: slot out of range");
  {
    std::lock_guard<std::mutex> hold(slots_lock);
    *found = slots[index];
  }
  if (found->kind == kEmpty) {
    return ffi::Error::Internal("mpigpu: this compiled call was not prepared in this process (stale compiled code?)");
  }
  return ffi::Error::Success();
}

// A per-device call: ncclAllReduce on this device's communicator, on this device's stream (NCCL makes the
// communicator's GPU current for the call and restores the thread's device). Not under call_lock. NCCL lets
// each GPU of a clique be driven by its own thread without a group, but "every NCCL call may have to block,
// waiting for other threads/ranks to arrive" (NCCL's guide, group calls): with NCCL_LAUNCH_MODE=GROUP a
// launch enters an intra-process barrier with the clique's other communicators of this process (src/group.cc,
// doLaunches; the default, PARALLEL, has none). So GPU 0's thread may wait inside ncclAllReduce until GPU 1's
// thread has called it too; under one process-wide lock GPU 1's thread would wait for the lock GPU 0's thread
// holds: a deadlock. Each thread uses only its own GPU's communicator (never two threads on one communicator,
// as NCCL requires), and XLA issues a device's calls in the program's order on that device's thread.
ffi::Error RunPerDevice(const Slot& s, void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                        int32_t ordinal, int64_t index) {
  int k = 0;
  while (k < s.devices && s.ordinals[k] != ordinal) ++k;
  if (k == s.devices) {
    return ffi::Error::Internal("mpigpu: XLA's device ordinal " + std::to_string(ordinal) +
                                " is not one of the GPUs this per-device call was compiled for");
  }
  Busy busy(index);  // the devices' calls overlap: the watchdog sees that one of them runs
  const int rc = ((NcclAllReduce)s.fn)(x.untyped_data(), out->untyped_data(), x.element_count(),
                                       static_cast<int>(s.datatype), static_cast<int>(s.op),
                                       reinterpret_cast<void*>(s.comms[k]), stream);
  if (rc != 0) return ffi::Error::Internal("mpigpu: NCCL returned error " + std::to_string(rc));
  return ffi::Error::Success();
}

ffi::Error Run(void* stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int32_t ordinal, int64_t index) {
  Slot s;
  if (ffi::Error e = Lookup(index, &s); e.failure()) return e;
  const size_t count = x.element_count();
  if (count == 0) return ffi::Error::Success();
  if (s.devices > 0) return RunPerDevice(s, stream, x, out, ordinal, index);
  std::lock_guard<std::mutex> hold(call_lock);
  Busy busy(index);
  int rc;
  if (s.kind == kNccl) {
    void* comm = reinterpret_cast<void*>(s.comm);
    const int dt = static_cast<int>(s.datatype);
    const size_t bytes = x.size_bytes();
    if (s.collective == kAllreduce) {
      rc = ((NcclAllReduce)s.fn)(x.untyped_data(), out->untyped_data(), count, dt, static_cast<int>(s.op), comm, stream);
    } else if (s.collective == kBroadcast) {
      rc = ((NcclBroadcast)s.fn)(x.untyped_data(), out->untyped_data(), bytes, dt, s.root, comm, stream);
    } else {
      rc = ((NcclAllGather)s.fn)(x.untyped_data(), out->untyped_data(), bytes, dt, comm, stream);
    }
    if (rc != 0) return ffi::Error::Internal("mpigpu: NCCL returned error " + std::to_string(rc));
    return ffi::Error::Success();
  }
  const int n = static_cast<int>(count);
  const int bytes = static_cast<int>(x.size_bytes());
  rc = s.handle_bytes == 4 ? MpiCall<int32_t>(s, x.untyped_data(), out->untyped_data(), n, bytes)
                           : MpiCall<void*>(s, x.untyped_data(), out->untyped_data(), n, bytes);
  if (rc != 0) return ffi::Error::Internal("mpigpu: MPI returned error " + std::to_string(rc));
  const bool divide = s.after == kAvgF32 || s.after == kAvgF64;
  if (s.after == kCanonF32 || s.after == kAvgF32) {
    Finish(static_cast<float*>(out->untyped_data()), count, s.nranks, divide, uint32_t{0x7fc00000u});
  } else if (s.after == kCanonF64 || s.after == kAvgF64) {
    Finish(static_cast<double*>(out->untyped_data()), count, s.nranks, divide, uint64_t{0x7ff8000000000000ull});
  }
  return ffi::Error::Success();
}

ffi::Error RunCpu(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> out,
                  int64_t index) {
  return Run(nullptr, x, out, 0, index);
}

ffi::Error RunGpu(void* stream, int32_t ordinal, ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                  ffi::Result<ffi::AnyBuffer> out, int64_t index) {
  return Run(stream, x, out, ordinal, index);
}

ffi::Error RunGpuPlain(void* stream, int32_t ordinal, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                       int64_t index) {
  return Run(stream, x, out, ordinal, index);
}

}  // namespace

extern "C" int mpigpu_native_set(int64_t index, const Slot* slot) {
  if (index < 0 || index >= kSlots) return 1;
  std::lock_guard<std::mutex> hold(slots_lock);
  slots[index] = *slot;
  return 0;
}

extern "C" int64_t mpigpu_native_slots() { return kSlots; }

// The slot of the call running now (-1: none), and the serial number of the latest call.
extern "C" int64_t mpigpu_native_busy(int64_t* serial) {
  const int64_t slot = busy_slot.load(std::memory_order_acquire);
  *serial = busy_serial.load(std::memory_order_relaxed);
  return slot;
}

extern "C" int64_t mpigpu_native_slot_bytes() { return sizeof(Slot); }

// Timing of the handler's calls (off by default): mpigpu_native_record(1) zeroes the sums and starts,
// mpigpu_native_record(0) stops; mpigpu_native_times reads calls, wall and CPU nanoseconds.
extern "C" void mpigpu_native_record(int on) {
  if (on) {
    timed_calls = 0;
    timed_wall_ns = 0;
    timed_cpu_ns = 0;
  }
  timing.store(on != 0);
}

extern "C" int64_t mpigpu_native_times(int64_t* wall_ns, int64_t* cpu_ns) {
  *wall_ns = timed_wall_ns.load();
  *cpu_ns = timed_cpu_ns.load();
  return timed_calls.load();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(mpigpu_native_cpu, RunCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("mpigpu_slot"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(mpigpu_native_gpu, RunGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("mpigpu_slot"));

// GPU programs without the ordered effect (MPIGPU_JAX_ORDER=auto): no token in or out
XLA_FFI_DEFINE_HANDLER_SYMBOL(mpigpu_native_gpu_plain, RunGpuPlain,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("mpigpu_slot"));
