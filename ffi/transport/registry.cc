#include "ffi/transport/registry.h"

#include <mutex>

#include "ffi/transport/settings.h"
#include "ffi/transport/ucx_world.h"

namespace jaxcomm::transport {
namespace {

std::unique_ptr<Transport> CreateUcxWorld(int world_size, std::vector<int> local_ranks,
                                          std::string* error) {
  return UcxWorld::Create(world_size, std::move(local_ranks), error);
}

// One row per transport; "auto" takes the first that moves the buffers' memory kind.
const std::vector<TransportEntry>& Table() {
  static const std::vector<TransportEntry>* table = new std::vector<TransportEntry>{
      {"ucx", /*host=*/true, /*device=*/false, /*device_staged=*/true, &CreateUcxWorld},
      {"nccl", /*host=*/false, /*device=*/true, /*device_staged=*/false, nullptr},
  };
  return *table;
}

const char* KindName(MemoryKind kind) {
  return kind == MemoryKind::kHost ? "host (CPU)" : "device (GPU)";
}

Selection SelectFromSetting(MemoryKind kind) {
  std::string name;
  if (std::string bad = ReadTransportName(&name); !bad.empty()) return Selection{nullptr, bad};
  return SelectTransport(kind, name);
}

}  // namespace

Selection SelectTransport(MemoryKind kind, std::string_view name) {
  Selection out;
  for (const TransportEntry& entry : Table()) {
    if (name == "auto" ? entry.Moves(kind) : name == entry.name) {
      out.entry = &entry;
      break;
    }
  }
  if (out.entry == nullptr || !out.entry->Accepts(kind)) {
    std::string movers;
    for (const TransportEntry& entry : Table()) {
      if (entry.Accepts(kind)) movers += std::string(movers.empty() ? "" : " or ") + entry.name;
    }
    out.error = std::string(kTransportVariable) + "='" + std::string(name) + "' cannot move " +
                KindName(kind) + " buffers in this build (" + movers +
                " can); unset it or set it to auto";
    out.entry = nullptr;
  }
  return out;
}

const std::vector<TransportEntry>& TransportTable() { return Table(); }

const TransportEntry* FindTransport(std::string_view name) {
  for (const TransportEntry& entry : Table()) {
    if (name == entry.name) return &entry;
  }
  return nullptr;
}

std::string TransportChoices() {
  std::string out = "auto";
  for (const TransportEntry& entry : Table()) out += std::string(", ") + entry.name;
  return out;
}

std::unique_ptr<Transport> CreateWorld(int world_size, std::vector<int> local_ranks,
                                       std::string* error) {
  for (const TransportEntry& entry : Table()) {
    if (entry.create_world != nullptr) {
      return entry.create_world(world_size, std::move(local_ranks), error);
    }
  }
  if (error) *error = "no transport of this build creates worlds";
  return nullptr;
}

const Selection& SelectedTransport(MemoryKind kind) {
  static std::once_flag once;
  static Selection* selections = nullptr;
  std::call_once(once, [] {
    selections = new Selection[2]{SelectFromSetting(MemoryKind::kHost),
                                  SelectFromSetting(MemoryKind::kDevice)};
  });
  return selections[kind == MemoryKind::kHost ? 0 : 1];
}

}  // namespace jaxcomm::transport
