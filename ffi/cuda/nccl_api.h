// The NCCL entry points jaxcomm uses, resolved at run time from the libnccl that is loaded.
//
// NCCL is opened with dlopen, not linked: libjaxcomm_ffi.so must keep loading on machines
// without NCCL (CPU-only use of a CUDA build), and on GPU machines the copy JAX already loaded
// (from the nvidia-nccl wheel) is the one to share. Python names the library once
// (SetNcclLibrary, from jaxcomm/config.py); the first user loads it.
#pragma once

#include <nccl.h>

#include <string>

namespace jaxcomm::nccl {

// Every NCCL function jaxcomm calls, once: X(member of NcclApi, NCCL symbol).
#define JAXCOMM_NCCL_FUNCTIONS(X)                \
  X(get_unique_id, ncclGetUniqueId)              \
  X(comm_init_rank, ncclCommInitRank)            \
  X(comm_abort, ncclCommAbort)                   \
  X(comm_get_async_error, ncclCommGetAsyncError) \
  X(group_start, ncclGroupStart)                 \
  X(group_end, ncclGroupEnd)                     \
  X(all_reduce, ncclAllReduce)                   \
  X(reduce_scatter, ncclReduceScatter)           \
  X(all_gather, ncclAllGather)                   \
  X(broadcast, ncclBroadcast)                    \
  X(send, ncclSend)                              \
  X(recv, ncclRecv)                              \
  X(error_string, ncclGetErrorString)

// The resolved entry points, e.g. api.all_reduce(...) calls the loaded ncclAllReduce.
struct NcclApi {
#define JAXCOMM_NCCL_MEMBER(member, symbol) decltype(&symbol) member = nullptr;
  JAXCOMM_NCCL_FUNCTIONS(JAXCOMM_NCCL_MEMBER)
#undef JAXCOMM_NCCL_MEMBER
};

// Path of libnccl.so.2 to open ("" = the loader's soname search). Takes effect only before the
// first LoadNccl.
void SetNcclLibrary(const std::string& path);

// The loaded API (thread-safe, loads once), or nullptr with the reason in *message.
const NcclApi* LoadNccl(std::string* message);

// "what failed: <NCCL's description>".
std::string NcclErrorString(const NcclApi& api, const char* what, ncclResult_t result);

}  // namespace jaxcomm::nccl
