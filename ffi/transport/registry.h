// The transports jaxcomm can run on, by name: one table, whose names the setting
// JAXCOMM_TRANSPORT (settings.h) chooses from. A row says which memory kinds the transport
// moves and how it comes to exist: as the world's transport (created with the world: its
// bootstrap, control channel and host data), or per group by the handlers that use it
// (NCCL: a communicator per group, bootstrapped over the world's transport).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ffi/transport/transport.h"

namespace jaxcomm::transport {

struct TransportEntry {
  const char* name;
  bool host;    // moves MemoryKind::kHost buffers
  bool device;  // moves MemoryKind::kDevice buffers
  // Moves device buffers through pinned host memory, for the GPU handlers that have such a
  // path (ffi/cuda/host_staged.h); "auto" never picks a row for this.
  bool device_staged;
  // Creates the world's transport, or null for a transport made per group by its handlers
  // (the nccl row: ffi/cuda/nccl_transport.h).
  std::unique_ptr<Transport> (*create_world)(int world_size, std::vector<int> local_ranks,
                                             std::string* error);
  // Whether the row moves `kind` itself (what "auto" asks).
  bool Moves(MemoryKind kind) const { return kind == MemoryKind::kHost ? host : device; }
  // Whether the row can be chosen for `kind` at all.
  bool Accepts(MemoryKind kind) const {
    return Moves(kind) || (kind == MemoryKind::kDevice && device_staged);
  }
};

// Every transport, in the order "auto" prefers them.
const std::vector<TransportEntry>& TransportTable();
// The row named `name`, or null.
const TransportEntry* FindTransport(std::string_view name);
// "auto, ucx, nccl": the values JAXCOMM_TRANSPORT takes.
std::string TransportChoices();

// Creates a world of `world_size` ranks hosting `local_ranks` with the first row that creates
// worlds (every world has one, whatever moves its device buffers). Null and *error on failure.
std::unique_ptr<Transport> CreateWorld(int world_size, std::vector<int> local_ranks,
                                       std::string* error);

// The transport that moves a collective's buffers of `kind` under JAXCOMM_TRANSPORT: the named
// row, or with "auto" the first row that moves `kind` itself (ucx for host, nccl for device). Read
// once per process (the first collective chooses); `error` names the setting and the fix where the
// choice cannot move `kind`.
struct Selection {
  const TransportEntry* entry = nullptr;
  std::string error;
};
const Selection& SelectedTransport(MemoryKind kind);
// The same choice for the setting's value `name` ("auto" or a row's name), read from no
// environment.
Selection SelectTransport(MemoryKind kind, std::string_view name);

}  // namespace jaxcomm::transport
