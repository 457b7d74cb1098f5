// Process-global registry of worlds (each a Transport made by registry.h's CreateWorld), keyed
// by the integer handle that Python's bootstrap (jaxcomm/_world.py through ffi/world_api.cc)
// hands out. FFI collective handlers receive the handle as an attribute and look the world up
// here.
#pragma once

#include <cstdint>
#include <memory>

#include "ffi/transport/transport.h"

namespace jaxcomm::transport {

// Takes ownership of `world` and returns its handle (> 0).
int64_t RegisterWorld(std::unique_ptr<Transport> world);
// The world registered as `handle`, or nullptr. The shared_ptr keeps it alive while a handler
// uses it, even if Python unregisters it meanwhile.
std::shared_ptr<Transport> GetWorld(int64_t handle);
// Removes `handle` from the registry; the world is destroyed when the last user lets go.
// Returns false if there was no such handle.
bool UnregisterWorld(int64_t handle);

}  // namespace jaxcomm::transport
