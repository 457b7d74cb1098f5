// The status header of every FFI handler (CPU and GPU): error propagation
// (JAXCOMM_RETURN_IF_ERROR), error text, thread-pool adapter, argument checks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <type_traits>

#include "ffi/registrations.h"  // JAXCOMM_DEFINE_HANDLER
#include "kernels/parallel.h"
#include "kernels/wire.h"
#include "xla/ffi/api/ffi.h"

// Declares an exported plain C function: the library is built with -fvisibility=hidden; the
// ctypes functions of jaxcomm/_ffi.py (C_FUNCTIONS) are its only exported symbols, the
// registration table (ffi/registrations.h) among them.
#define JAXCOMM_C_API extern "C" __attribute__((visibility("default")))

// Returns the ffi::Error of the expression unless it succeeded: the one way handlers
// propagate errors.
// Variadic so that an argument with braces ({a, b}) stays one expression.
#define JAXCOMM_RETURN_IF_ERROR(...)                                                   \
  do {                                                                                 \
    if (::xla::ffi::Error jaxcomm_error_ = (__VA_ARGS__); !jaxcomm_error_.success()) { \
      return jaxcomm_error_;                                                           \
    }                                                                                  \
  } while (0)

namespace jaxcomm::ffi_common {

namespace ffi = xla::ffi;

// Adapts XLA's intra-op thread pool to kernels::TaskRunner. The calling thread works on the
// tasks too and never waits on a task nobody started, so the runner cannot deadlock when the
// pool's threads are busy (e.g. all of them running shard_map device programs).
kernels::TaskRunner PoolRunner(ffi::ThreadPool* pool);

// Number of elements of a buffer, as int64.
template <typename BufferT>
int64_t NumElements(const BufferT& buffer) {
  return static_cast<int64_t>(buffer.element_count());
}

// InvalidArgument error prefixed with the op's Python name, e.g. "jaxcomm.ops.topk_abs: ...".
inline ffi::Error InvalidArgument(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// InvalidArgument unless x's n elements are within what the kernels take: at least
// `min_elements` and at most kernels::wire::kMaxElements (2**31 - 1).
inline ffi::Error CheckElementCount(const char* op, int64_t n, int64_t min_elements = 0) {
  if (n >= min_elements && n <= kernels::wire::kMaxElements) return ffi::Error::Success();
  const std::string range =
      min_elements > 0 ? std::to_string(min_elements) + " to 2**31 - 1" : "at most 2**31 - 1";
  return InvalidArgument(op, "x must have " + range + " elements, got " + std::to_string(n));
}

// Error when a non-finite value was found at `index` of the accumulated input.
inline ffi::Error NonFinite(const char* op, int64_t index) {
  return InvalidArgument(op, "x + residual holds a NaN or Inf at flat index " +
                                 std::to_string(index) +
                                 "; quantizers cannot encode it (check the gradients, e.g. "
                                 "with jax.debug_nans, or lower the learning rate)");
}

// Device scratch memory from XLA's allocator for the CUDA handlers: `bytes` (at least 1)
// starting at a multiple of 256 bytes (what the CUDA kernels carve their pieces at) into *out,
// or a ResourceExhausted error naming `op`. XLA's allocator fails any alignment above 16 (seen
// with jaxlib 0.11.2 on an H200; the reason only reaches XLA's diagnostics), so the 256 comes
// from asking for 255 bytes more and rounding the pointer up.
inline ffi::Error AllocateScratch(ffi::ScratchAllocator& scratch, const char* op, size_t bytes,
                                  void** out) {
  constexpr uintptr_t kAlign = 256;
  const size_t wanted = bytes > 0 ? bytes : 1;
  std::optional<void*> memory = scratch.Allocate(wanted + kAlign - 1, 16);
  if (!memory) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": could not allocate " + std::to_string(bytes) +
                          " bytes of GPU scratch memory");
  }
  *out =
      reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(*memory) + kAlign - 1) & ~(kAlign - 1));
  return ffi::Error::Success();
}

// The ctypes convention of the library's JSON readers (metrics, timeline marks): copies `json`
// into `buffer` (NUL-terminated, truncated to `capacity` - 1) and returns its full length, so
// the caller asks again with a larger buffer when the result is >= capacity.
int64_t CopyJson(const std::string& json, char* buffer, int64_t capacity);

// Builds text (the JSON of the ctypes readers, error messages) with `<<` like an
// ostringstream, without iostreams: numbers go through snprintf ("%.15g" keeps microseconds of a
// clock that counts from boot), whatever the C++ locale. On the GPU machine (jaxlib 0.11.2,
// library built with GCC 13.3) ostream's number formatting crashed inside
// jaxcomm_metrics_json; this builder does not depend on the locale machinery at all.
class TextBuilder {
 public:
  TextBuilder& operator<<(const char* text) {
    text_ += text;
    return *this;
  }
  TextBuilder& operator<<(const std::string& text) {
    text_ += text;
    return *this;
  }
  TextBuilder& operator<<(char c) {  // a character, as ostream prints it (not its code)
    text_ += c;
    return *this;
  }
  template <typename T, typename = std::enable_if_t<std::is_arithmetic_v<T>>>
  TextBuilder& operator<<(T value) {
    char digits[32];
    if constexpr (std::is_floating_point_v<T>) {
      std::snprintf(digits, sizeof(digits), "%.15g", static_cast<double>(value));
    } else if constexpr (std::is_signed_v<T>) {
      std::snprintf(digits, sizeof(digits), "%lld", static_cast<long long>(value));
    } else {
      std::snprintf(digits, sizeof(digits), "%llu", static_cast<unsigned long long>(value));
    }
    text_ += digits;
    return *this;
  }
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

}  // namespace jaxcomm::ffi_common
