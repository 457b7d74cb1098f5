// Helpers shared by the transport unit tests (ffi/transport/tests/*_test.cc).
#pragma once

#include <stdlib.h>

namespace jaxcomm::transport {

// Sets the environment variable `name` to `value` for the scope of the object (unset again
// afterwards), e.g. ScopedEnv spin("JAXCOMM_UCX_SPIN_US", "2.5").
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

}  // namespace jaxcomm::transport
