#include "ffi/registrations.h"

#include <cstring>
#include <vector>

#include "ffi/common.h"

// One row of the table, as jaxcomm/_ffi.py's _Registration mirrors it (ctypes.Structure).
struct JaxcommRegistration {
  const char* target;  // the XLA custom-call target name Python's ffi_call uses
  XLA_FFI_Handler* cpu;
  XLA_FFI_Handler* cuda;  // null in builds without CUDA and for CPU-only targets
  int32_t flags;          // kGpuSplit, kDuplicate (ffi/registrations.h)
};

namespace jaxcomm::registrations {
namespace {

// Built during static initialization (one thread), read-only afterwards. A function-local
// static, so it exists before the first registrar of any file runs.
std::vector<JaxcommRegistration>& Table() {
  static std::vector<JaxcommRegistration> table;
  return table;
}

}  // namespace

bool Register(const char* target, Platform platform, XLA_FFI_Handler* handler, int32_t flags) {
  std::vector<JaxcommRegistration>& table = Table();
  JaxcommRegistration* row = nullptr;
  for (JaxcommRegistration& existing : table) {
    if (std::strcmp(existing.target, target) == 0) row = &existing;
  }
  if (row == nullptr) row = &table.emplace_back(JaxcommRegistration{target, nullptr, nullptr, 0});
  XLA_FFI_Handler*& slot = platform == Platform::kCpu ? row->cpu : row->cuda;
  if (slot != nullptr) row->flags |= kDuplicate;
  slot = handler;
  row->flags |= flags;
  return true;
}

}  // namespace jaxcomm::registrations

// ctypes entry point for jaxcomm/_ffi.py: points *rows at the table and returns its length.
JAXCOMM_C_API int64_t jaxcomm_registrations(const JaxcommRegistration** rows) {
  const std::vector<JaxcommRegistration>& table = jaxcomm::registrations::Table();
  *rows = table.data();
  return static_cast<int64_t>(table.size());
}
