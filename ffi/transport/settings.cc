#include "ffi/transport/settings.h"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "ffi/transport/registry.h"

namespace jaxcomm::transport {

std::string Read(const NumberSetting& setting, double* value) {
  *value = setting.fallback;
  const char* env = std::getenv(setting.name);
  if (env == nullptr || *env == '\0') return "";
  // Strict, as jaxcomm/config.py checks it at import: the whole text is one finite number.
  char* end = nullptr;
  const double parsed = std::strtod(env, &end);
  while (end != env && std::isspace(static_cast<unsigned char>(*end))) ++end;
  const bool in_range = setting.zero_allowed ? parsed >= 0 : parsed > 0;
  if (end == env || *end != '\0' || !std::isfinite(parsed) || !in_range) {
    char example[32];
    std::snprintf(example, sizeof(example), "%g", setting.fallback);
    const std::string name = setting.name;
    return name + "='" + env + "' is not a number " + (setting.zero_allowed ? ">=" : ">") +
           " 0; unset it or set e.g. " + name + "=" + example;
  }
  *value = parsed;
  return "";
}

double ValueOrFallback(const NumberSetting& setting) {
  double value = 0;
  return Read(setting, &value).empty() ? value : setting.fallback;
}

std::string ReadWaitMode(WaitMode* mode) {
  *mode = WaitMode::kWakeup;
  const char* env = std::getenv("JAXCOMM_UCX_WAIT");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "wakeup") == 0) return "";
  if (std::strcmp(env, "backoff") == 0) {
    *mode = WaitMode::kBackoff;
    return "";
  }
  return std::string("JAXCOMM_UCX_WAIT='") + env + "' is not 'wakeup' or 'backoff'";
}

const char* WaitModeName(WaitMode mode) {
  return mode == WaitMode::kBackoff ? "backoff" : "wakeup";
}

bool SharedMemoryEnabled() {
  const char* env = std::getenv("JAXCOMM_SHARED_MEMORY");
  return env == nullptr || *env == '\0' || std::strcmp(env, "0") != 0;
}

std::string ReadTransportName(std::string* name) {
  *name = "auto";
  const char* env = std::getenv("JAXCOMM_TRANSPORT");
  if (env == nullptr || *env == '\0') return "";
  if (std::strcmp(env, "auto") != 0 && FindTransport(env) == nullptr) {
    return std::string(kTransportVariable) + "='" + env + "' is not one of " + TransportChoices();
  }
  *name = env;
  return "";
}

std::string CheckWorldSettings() {
  WaitMode mode;
  double value = 0;
  std::string transport;
  for (std::string error : {ReadWaitMode(&mode), Read(kSpinMicroseconds, &value),
                            Read(kTimeoutSeconds, &value), ReadTransportName(&transport)}) {
    if (!error.empty()) return error;
  }
  return "";
}

std::chrono::nanoseconds DefaultTimeout() {
  return std::chrono::nanoseconds(static_cast<int64_t>(ValueOrFallback(kTimeoutSeconds) * 1e9));
}

Deadline DefaultDeadline() { return Clock::now() + DefaultTimeout(); }

}  // namespace jaxcomm::transport
