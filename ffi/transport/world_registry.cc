#include "ffi/transport/world_registry.h"

#include <map>
#include <mutex>

namespace jaxcomm::transport {

namespace {

struct Registry {
  std::mutex mu;
  int64_t next_handle = 1;
  std::map<int64_t, std::shared_ptr<Transport>> worlds;
};

Registry& GlobalRegistry() {
  // Leaked on purpose: handlers may still run during static destruction at process exit.
  static Registry* registry = new Registry();
  return *registry;
}

}  // namespace

int64_t RegisterWorld(std::unique_ptr<Transport> world) {
  Registry& r = GlobalRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  int64_t handle = r.next_handle++;
  r.worlds.emplace(handle, std::shared_ptr<Transport>(std::move(world)));
  return handle;
}

std::shared_ptr<Transport> GetWorld(int64_t handle) {
  Registry& r = GlobalRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.worlds.find(handle);
  return it == r.worlds.end() ? nullptr : it->second;
}

bool UnregisterWorld(int64_t handle) {
  std::shared_ptr<Transport> doomed;  // destroyed outside the lock (teardown may take a while)
  Registry& r = GlobalRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.worlds.find(handle);
  if (it == r.worlds.end()) return false;
  doomed = std::move(it->second);
  r.worlds.erase(it);
  return true;
}

}  // namespace jaxcomm::transport
