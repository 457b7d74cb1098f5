// The NCCL entry points jaxcomm uses, resolved at run time from the libnccl that is loaded.
//
// NCCL is opened with dlopen, not linked: libjaxcomm_ffi.so must keep loading on machines
// without NCCL (CPU-only use of a CUDA build), and on GPU machines the copy JAX already loaded
// (from the nvidia-nccl wheel) is the one to share. Python names the library once
// (SetNcclLibrary, from jaxcomm/collectives/nccl.py); the first user loads it.
#pragma once

#include <nccl.h>

#include <string>

namespace jaxcomm::nccl {

struct NcclApi {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
};

// Path of libnccl.so.2 to open ("" = the loader's soname search). Takes effect only before the
// first LoadNccl.
void SetNcclLibrary(const std::string& path);

// The loaded API (thread-safe, loads once), or nullptr with the reason in *message.
const NcclApi* LoadNccl(std::string* message);

// "what failed: <NCCL's description>".
std::string NcclErrorString(const NcclApi& api, const char* what, ncclResult_t result);

}  // namespace jaxcomm::nccl
