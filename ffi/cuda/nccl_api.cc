#include "ffi/cuda/nccl_api.h"

#include <dlfcn.h>

#include <mutex>
#include <type_traits>

namespace jaxcomm::nccl {
namespace {

std::mutex mutex;
std::string library_path;
NcclApi api;
bool loaded = false;

}  // namespace

void SetNcclLibrary(const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex);
  if (!loaded) library_path = path;
}

const NcclApi* LoadNccl(std::string* message) {
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded) return &api;
  const char* path = library_path.empty() ? "libnccl.so.2" : library_path.c_str();
  void* lib = dlopen(path, RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr) {
    *message = std::string("cannot load NCCL (") + path + "): " + dlerror() +
               "; install nvidia-nccl-cu12 (comes with jax[cuda12])";
    return nullptr;
  }
  NcclApi found;
  bool ok = true;
  auto resolve = [&](auto* slot, const char* name) {
    *slot = reinterpret_cast<std::remove_pointer_t<decltype(slot)>>(dlsym(lib, name));
    if (*slot == nullptr && ok) {
      ok = false;
      *message = std::string("NCCL library ") + path + " lacks " + name + " (need NCCL >= 2.7)";
    }
  };
#define JAXCOMM_NCCL_RESOLVE(member, symbol) resolve(&found.member, #symbol);
  JAXCOMM_NCCL_FUNCTIONS(JAXCOMM_NCCL_RESOLVE)
#undef JAXCOMM_NCCL_RESOLVE
  if (!ok) return nullptr;
  api = found;
  loaded = true;
  return &api;
}

std::string NcclErrorString(const NcclApi& nccl, const char* what, ncclResult_t result) {
  return std::string(what) +
         " failed: " + (nccl.error_string ? nccl.error_string(result) : "unknown NCCL error");
}

}  // namespace jaxcomm::nccl
