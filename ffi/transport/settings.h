// Every JAXCOMM_* environment setting the C++ code reads, each declared once here with its
// default and its range, and read only through these functions. jaxcomm/config.py (SETTINGS)
// declares the same variables for Python and refuses a bad value at import; the C++ reads are
// as strict, so a library used without the Python package refuses it too (UcxWorld::Create).
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "ffi/transport/status.h"

namespace jaxcomm::transport {

// A setting whose value is one finite number: > 0, or >= 0 with `zero_allowed`.
struct NumberSetting {
  const char* name;
  double fallback;  // when unset or empty
  bool zero_allowed;
};

// Deadline of every transport wait, seconds (may be fractional).
inline constexpr NumberSetting kTimeoutSeconds{"JAXCOMM_TIMEOUT_S", 120.0, false};
// How long a wait polls (UCX, or a same-host peer's notice) before it sleeps, microseconds.
inline constexpr NumberSetting kSpinMicroseconds{"JAXCOMM_UCX_SPIN_US", 20.0, true};
// The largest dense float32 allreduce (bytes) that takes the latency-optimal schedules
// (ffi/allreduce.h); 0 turns them off.
inline constexpr NumberSetting kSmallAllreduceBytes{"JAXCOMM_SMALL_ALLREDUCE_BYTES", 32768.0, true};

// Reads `setting` into *value (its fallback when unset or empty), strictly, as
// jaxcomm/config.py checks it at import: the whole text one finite number in range. Returns ""
// or, for an invalid value, the error naming the variable (and *value is the fallback).
std::string Read(const NumberSetting& setting, double* value);
// The value of `setting`, or its fallback when the value is invalid (refused earlier by
// CheckWorldSettings or by jaxcomm.config at import).
double ValueOrFallback(const NumberSetting& setting);

// How a rank waits for UCX (env JAXCOMM_UCX_WAIT): sleep on the worker's event fd ("wakeup",
// the default) or poll with growing sleeps ("backoff").
enum class WaitMode { kWakeup, kBackoff };
// Reads JAXCOMM_UCX_WAIT into *mode; "" or the error naming the variable.
std::string ReadWaitMode(WaitMode* mode);
const char* WaitModeName(WaitMode mode);

// Whether ranks of one host may read each other's memory and exchange notices in shared
// memory (env JAXCOMM_SHARED_MEMORY; anything but "0" is on, the default).
bool SharedMemoryEnabled();

// Which transport moves a collective's buffers (env JAXCOMM_TRANSPORT): "auto" (the default:
// the first transport of registry.h's table that accepts the buffers' memory kind, i.e. ucx
// for host buffers, nccl for GPU buffers) or the name of a row of that table.
inline constexpr char kTransportVariable[] = "JAXCOMM_TRANSPORT";
// Reads JAXCOMM_TRANSPORT into *name ("auto" when unset or empty); "" or the error naming the
// variable and its choices (and *name is "auto").
std::string ReadTransportName(std::string* name);

// "" when every setting a world reads is valid, else the first error (UcxWorld::Create fails
// with it, so a bad value fails early rather than at the first wait).
std::string CheckWorldSettings();

// The default timeout of every transport wait: JAXCOMM_TIMEOUT_S, default 120 s. Read on each
// call (tests change it at run time).
std::chrono::nanoseconds DefaultTimeout();
// Clock::now() + DefaultTimeout().
Deadline DefaultDeadline();

}  // namespace jaxcomm::transport
