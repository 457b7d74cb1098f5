// Dense allreduce over NCCL on XLA's stream (platform "CUDA"), and the C entry points that
// jaxcomm/collectives/nccl.py uses to build the communicator.
//
// NCCL is opened with dlopen when the first communicator is created, not linked: the library
// must keep loading on machines without NCCL (CPU-only use of a CUDA build), and on GPU
// machines the copy JAX already loaded (from the nvidia-nccl wheel) is the one to share. The
// unique id travels through the jax.distributed key-value store (done in Python), so this file
// has no bootstrap of its own.
//
// One communicator spans every device of the world (NCCL rank = position in the device list
// sorted by JAX device id). The handler finds the communicator of its device through
// Ctx<DeviceOrdinal> (the local CUDA ordinal) and enqueues ncclAllReduce on the XLA stream; it
// never synchronizes. Not marked command-buffer compatible: NCCL inside CUDA graphs needs
// XLA's own NCCL integration, which a custom call does not get.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::nccl {
namespace {

namespace ffi = xla::ffi;

// The NCCL functions used, resolved from the loaded libnccl.
struct Api {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
};

std::mutex mutex;
Api api;
bool api_loaded = false;
std::map<int64_t, std::map<int, ncclComm_t>> communicators;  // handle -> device ordinal -> comm
int64_t next_handle = 1;

void SetError(char* error, int64_t capacity, const std::string& message) {
  if (error == nullptr || capacity <= 0) return;
  std::strncpy(error, message.c_str(), static_cast<size_t>(capacity - 1));
  error[capacity - 1] = '\0';
}

// Opens libnccl (the given path, else the soname the JAX plugin has usually loaded already).
bool LoadApi(const char* path, std::string* message) {
  if (api_loaded) return true;
  void* lib = dlopen(path && *path ? path : "libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    *message = std::string("cannot load NCCL (") + (path && *path ? path : "libnccl.so.2") +
               "): " + dlerror() + "; install nvidia-nccl-cu12 (comes with jax[cuda12])";
    return false;
  }
  Api loaded;
  bool ok = true;
  auto resolve = [&](auto* slot, const char* name) {
    *slot = reinterpret_cast<std::remove_pointer_t<decltype(slot)>>(dlsym(lib, name));
    if (*slot == nullptr) {
      ok = false;
      *message = std::string("NCCL library lacks ") + name;
    }
  };
  resolve(&loaded.get_unique_id, "ncclGetUniqueId");
  resolve(&loaded.comm_init_rank, "ncclCommInitRank");
  resolve(&loaded.comm_destroy, "ncclCommDestroy");
  resolve(&loaded.group_start, "ncclGroupStart");
  resolve(&loaded.group_end, "ncclGroupEnd");
  resolve(&loaded.all_reduce, "ncclAllReduce");
  resolve(&loaded.error_string, "ncclGetErrorString");
  if (!ok) return false;
  api = loaded;
  api_loaded = true;
  return true;
}

std::string NcclError(const char* what, ncclResult_t result) {
  return std::string(what) + " failed: " + (api.error_string ? api.error_string(result) : "?");
}

constexpr char kAllreduceOp[] = "jaxcomm.collectives.nccl_allreduce";

ffi::Error AllreduceCuda(cudaStream_t stream, int32_t device_ordinal, ffi::Buffer<ffi::F32> x,
                         int64_t comm_handle, ffi::ResultBuffer<ffi::F32> out) {
  ncclComm_t comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = communicators.find(comm_handle);
    if (it != communicators.end()) {
      auto found = it->second.find(device_ordinal);
      if (found != it->second.end()) comm = found->second;
    }
  }
  if (comm == nullptr) {
    return ffi_common::InvalidArgument(
        kAllreduceOp, "no NCCL communicator " + std::to_string(comm_handle) + " on device " +
                          std::to_string(device_ordinal) +
                          "; create it with jaxcomm.collectives.nccl.communicator() first");
  }
  const ncclResult_t result = api.all_reduce(x.typed_data(), out->typed_data(), x.element_count(),
                                             ncclFloat32, ncclSum, comm, stream);
  if (result != ncclSuccess) {
    return ffi::Error::Internal(std::string(kAllreduceOp) + ": " +
                                NcclError("ncclAllReduce", result));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxcomm::nccl

extern "C" {

// Writes NCCL_UNIQUE_ID_BYTES bytes of a fresh unique id into `out`. Returns the byte count,
// or -1 with a message in `error`.
__attribute__((visibility("default"))) int64_t jaxcomm_nccl_unique_id(const char* library,
                                                                      char* out, int64_t capacity,
                                                                      char* error,
                                                                      int64_t error_capacity) {
  using namespace jaxcomm::nccl;
  std::lock_guard<std::mutex> lock(mutex);
  std::string message;
  if (!LoadApi(library, &message)) {
    SetError(error, error_capacity, message);
    return -1;
  }
  if (capacity < NCCL_UNIQUE_ID_BYTES) {
    SetError(error, error_capacity, "unique id buffer too small");
    return -1;
  }
  ncclUniqueId id;
  const ncclResult_t result = api.get_unique_id(&id);
  if (result != ncclSuccess) {
    SetError(error, error_capacity, NcclError("ncclGetUniqueId", result));
    return -1;
  }
  std::memcpy(out, id.internal, NCCL_UNIQUE_ID_BYTES);
  return NCCL_UNIQUE_ID_BYTES;
}

// Creates this process's ranks of a communicator of `nranks`: local rank ranks[i] on CUDA
// device device_ordinals[i]. Collective with the other processes (they call it with the same
// id). Returns 0 and a handle, or -1 with a message in `error`.
__attribute__((visibility("default"))) int jaxcomm_nccl_comm_create(
    const char* library, const char* unique_id, int nranks, const int* ranks,
    const int* device_ordinals, int count, int64_t* handle, char* error, int64_t error_capacity) {
  using namespace jaxcomm::nccl;
  std::lock_guard<std::mutex> lock(mutex);
  std::string message;
  if (!LoadApi(library, &message)) {
    SetError(error, error_capacity, message);
    return -1;
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id, NCCL_UNIQUE_ID_BYTES);
  int previous_device = 0;
  cudaGetDevice(&previous_device);
  std::vector<ncclComm_t> comms(count, nullptr);
  // One thread initializes several ranks: NCCL requires a group call for that.
  ncclResult_t result = api.group_start();
  for (int i = 0; i < count && result == ncclSuccess; ++i) {
    if (cudaSetDevice(device_ordinals[i]) != cudaSuccess) {
      SetError(error, error_capacity, "cudaSetDevice(" + std::to_string(device_ordinals[i]) + ")");
      api.group_end();
      cudaSetDevice(previous_device);
      return -1;
    }
    result = api.comm_init_rank(&comms[i], nranks, id, ranks[i]);
  }
  const ncclResult_t end = api.group_end();
  cudaSetDevice(previous_device);
  if (result != ncclSuccess || end != ncclSuccess) {
    SetError(error, error_capacity,
             NcclError("ncclCommInitRank", result != ncclSuccess ? result : end));
    return -1;
  }
  const int64_t h = next_handle++;
  for (int i = 0; i < count; ++i) communicators[h][device_ordinals[i]] = comms[i];
  *handle = h;
  return 0;
}

__attribute__((visibility("default"))) int jaxcomm_nccl_comm_destroy(int64_t handle) {
  using namespace jaxcomm::nccl;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = communicators.find(handle);
  if (it == communicators.end()) return -1;
  for (auto& [device, comm] : it->second) api.comm_destroy(comm);
  communicators.erase(it);
  return 0;
}

}  // extern "C"

JAXCOMM_EXPORT_HANDLER(JaxcommNcclAllreduceCuda);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxcommNcclAllreduceCuda, jaxcomm::nccl::AllreduceCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<xla::ffi::DeviceOrdinal>()          // local CUDA ordinal
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // x: this shard
                                  .Attr<int64_t>("comm")  // jaxcomm_nccl_comm_create handle
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // sum over all ranks
);
