// Tests of the C++ settings (ffi/transport/settings.h): the strict number parse that matches
// jaxcomm/config.py, the fallbacks, and the wait-mode and shared-memory switches.
#include "ffi/transport/settings.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "ffi/transport/tests/scoped_env.h"

namespace jaxcomm::transport {
namespace {

TEST(Settings, UnsetOrEmptyGivesTheFallback) {
  double value = -1;
  EXPECT_EQ(Read(kTimeoutSeconds, &value), "");
  EXPECT_EQ(value, 120.0);
  ScopedEnv empty("JAXCOMM_TIMEOUT_S", "");
  EXPECT_EQ(Read(kTimeoutSeconds, &value), "");
  EXPECT_EQ(value, 120.0);
}

TEST(Settings, ReadsAWholeFiniteNumber) {
  ScopedEnv spin("JAXCOMM_UCX_SPIN_US", " 2.5 ");
  double value = 0;
  EXPECT_EQ(Read(kSpinMicroseconds, &value), "");
  EXPECT_EQ(value, 2.5);
  EXPECT_EQ(ValueOrFallback(kSpinMicroseconds), 2.5);
}

TEST(Settings, RefusesWhatConfigPyRefusesNamingTheVariable) {
  for (const char* bad : {"fast", "5s", "-1", "nan", "inf"}) {
    ScopedEnv spin("JAXCOMM_UCX_SPIN_US", bad);
    double value = 0;
    const std::string error = Read(kSpinMicroseconds, &value);
    EXPECT_NE(error.find(std::string("JAXCOMM_UCX_SPIN_US='") + bad + "'"), std::string::npos)
        << error;
    EXPECT_NE(error.find("e.g. JAXCOMM_UCX_SPIN_US=20"), std::string::npos) << error;
    EXPECT_EQ(value, 20.0);  // the fallback stands
    EXPECT_EQ(ValueOrFallback(kSpinMicroseconds), 20.0);
  }
  // Zero: allowed for the spin, not for the timeout.
  ScopedEnv spin("JAXCOMM_UCX_SPIN_US", "0");
  EXPECT_EQ(ValueOrFallback(kSpinMicroseconds), 0.0);
  ScopedEnv timeout("JAXCOMM_TIMEOUT_S", "0");
  double value = 0;
  EXPECT_NE(Read(kTimeoutSeconds, &value).find("is not a number > 0"), std::string::npos);
  EXPECT_EQ(DefaultTimeout(), std::chrono::seconds(120));
  EXPECT_NE(CheckWorldSettings().find("JAXCOMM_TIMEOUT_S='0'"), std::string::npos);
}

TEST(Settings, WaitMode) {
  WaitMode mode = WaitMode::kBackoff;
  EXPECT_EQ(ReadWaitMode(&mode), "");
  EXPECT_EQ(mode, WaitMode::kWakeup);
  {
    ScopedEnv wait("JAXCOMM_UCX_WAIT", "backoff");
    EXPECT_EQ(ReadWaitMode(&mode), "");
    EXPECT_STREQ(WaitModeName(mode), "backoff");
  }
  ScopedEnv wait("JAXCOMM_UCX_WAIT", "spin");
  EXPECT_NE(ReadWaitMode(&mode).find("JAXCOMM_UCX_WAIT='spin'"), std::string::npos);
  EXPECT_EQ(mode, WaitMode::kWakeup);
  EXPECT_NE(CheckWorldSettings().find("JAXCOMM_UCX_WAIT"), std::string::npos);
}

TEST(Settings, SharedMemoryIsOnUnlessZero) {
  EXPECT_TRUE(SharedMemoryEnabled());
  {
    ScopedEnv off("JAXCOMM_SHARED_MEMORY", "0");
    EXPECT_FALSE(SharedMemoryEnabled());
  }
  ScopedEnv on("JAXCOMM_SHARED_MEMORY", "1");
  EXPECT_TRUE(SharedMemoryEnabled());
  EXPECT_EQ(CheckWorldSettings(), "");
}

}  // namespace
}  // namespace jaxcomm::transport
