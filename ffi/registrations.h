// The library's registration table: every XLA FFI target name with its CPU handler and, in a
// CUDA build, its CUDA handler. jaxcomm/_ffi.py reads it through jaxcomm_registrations() and
// registers every row, so Python never names a C++ symbol (jax's examples/ffi and
// TransformerEngine export their handlers the same way). The handlers have no exported (or
// even named) symbol: the table is the only way in.
//
// A handler adds its own row where it is defined: JAXCOMM_DEFINE_HANDLER (below) and the
// collective macros (ffi/collective_handler.h, ffi/cuda/gpu_collective.h) take the target name
// and register the handler while the library loads, as XLA_FFI_REGISTER_HANDLER does inside
// XLA. A new op is then one file: its handlers, each named by its target alone.
#pragma once

#include <cstdint>

#include "xla/ffi/api/api.h"
#include "xla/ffi/api/c_api.h"

namespace jaxcomm::registrations {

enum class Platform { kCpu, kCuda };

// Row flags (jaxcomm/_ffi.py reads them).
// The CUDA handler may run split (start/done) on jaxcomm's own stream: it takes no XLA scratch
// memory (JAXCOMM_DEFINE_GPU_COLLECTIVE_SPLITTABLE; the other CUDA collectives refuse `split`).
// Every CPU collective may split.
inline constexpr int32_t kGpuSplit = 1;
// A second handler was defined for the same target and platform (a programming error that
// static initialization cannot report): Python refuses to load the table.
inline constexpr int32_t kDuplicate = 2;

// Adds `handler` to the table as `target`'s handler on `platform`, with `flags`. Called by the
// definition macros during the library's static initialization; returns true, the value of
// the macro's registrar variable.
bool Register(const char* target, Platform platform, XLA_FFI_Handler* handler, int32_t flags);

}  // namespace jaxcomm::registrations

#define JAXCOMM_CONCAT_(a, b) a##b
#define JAXCOMM_CONCAT(a, b) JAXCOMM_CONCAT_(a, b)

// Defines a handler (XLA_FFI_DEFINE_HANDLER: `impl` bound by the binding that follows,
// optionally with traits) and registers it as `target` on `platform` (kCpu or kCuda) with
// `flags`. The handler is a static function pointer with a generated name: nothing names it but
// its row. Use it at namespace scope (an anonymous namespace is fine).
#define JAXCOMM_REGISTER_FFI(target, platform, flags, impl, ...) \
  JAXCOMM_REGISTER_FFI_(__COUNTER__, target, platform, flags, impl, __VA_ARGS__)
#define JAXCOMM_REGISTER_FFI_(id, target, platform, flags, impl, ...)                          \
  XLA_FFI_DEFINE_HANDLER(JAXCOMM_CONCAT(jaxcomm_handler_, id), impl, __VA_ARGS__);             \
  [[maybe_unused]] const bool JAXCOMM_CONCAT(jaxcomm_registered_, id) =                        \
      ::jaxcomm::registrations::Register(target, ::jaxcomm::registrations::Platform::platform, \
                                         JAXCOMM_CONCAT(jaxcomm_handler_, id), flags)

// The handler of `target` on platform "cpu" (JAXCOMM_DEFINE_HANDLER) or "CUDA"
// (JAXCOMM_DEFINE_CUDA_HANDLER): `impl` bound by the binding (and traits) that follow.
#define JAXCOMM_DEFINE_HANDLER(target, impl, ...) \
  JAXCOMM_REGISTER_FFI(target, kCpu, 0, impl, __VA_ARGS__)
#define JAXCOMM_DEFINE_CUDA_HANDLER(target, impl, ...) \
  JAXCOMM_REGISTER_FFI(target, kCuda, 0, impl, __VA_ARGS__)
