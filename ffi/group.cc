#include "ffi/group.h"

#include <algorithm>
#include <atomic>
#include <ctime>
#include <map>
#include <mutex>
#include <utility>

#include "ffi/common.h"
#include "ffi/engine.h"
#include "ffi/metrics.h"
#include "ffi/transport/registry.h"
#include "ffi/transport/settings.h"
#include "ffi/transport/world_registry.h"

namespace jaxcomm::collectives {
namespace {

using transport::MakeControlTag;
using transport::MakeTag;
using transport::Request;

// State one world rank keeps across calls. Only that rank's engine thread (ffi/engine.h)
// changes it; next_seq is atomic because a local peer's failing wait reads it to tell whether
// this rank ever started the collective it waits for.
struct RankState {
  std::atomic<uint32_t> next_seq{1};
  uint32_t next_control_seq = 1;
  // mesh axis sizes -> world rank at each row-major mesh position
  std::map<std::vector<int64_t>, std::vector<int>> mesh_tables;
};

std::mutex g_state_mu;
std::map<std::pair<int64_t, int>, std::unique_ptr<RankState>> g_rank_states;

RankState* StateOf(int64_t world_handle, int world_rank) {
  std::lock_guard<std::mutex> lock(g_state_mu);
  auto& slot = g_rank_states[{world_handle, world_rank}];
  if (!slot) slot = std::make_unique<RankState>();
  return slot.get();
}

ffi::Error Fail(const char* name, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(name) + ": " + message);
}

// A transport failure breaks the links it touched (ffi/transport/transport.h): stop the engine so
// every collective queued behind this one fails at once with the same message.
ffi::Error FromStatus(const transport::Status& status) {
  if (status.code() == transport::StatusCode::kDeadlineExceeded ||
      status.code() == transport::StatusCode::kPeerFailed) {
    return ffi::Error::Internal(StopEngine(status.message()));
  }
  return ffi::Error::Internal(status.message());
}

std::string JoinInts(const std::vector<int64_t>& values) {
  std::string out;
  for (int64_t v : values) out += (out.empty() ? "" : ", ") + std::to_string(v);
  return out;
}

// One-time exchange of mesh positions among all world ranks (once per mesh shape).
ffi::Error DiscoverMesh(transport::Transport& world, RankState& state, const char* name, int self,
                        int64_t position, std::vector<int>* table) {
  const int world_size = world.world_size();
  const uint32_t control_seq = state.next_control_seq++;
  std::vector<int64_t> positions(world_size, -1);
  positions[self] = position;
  std::vector<Request> requests;
  requests.reserve(2 * world_size);
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == self) continue;
    requests.push_back(world.PostRecv(self, peer, MakeControlTag(control_seq, 0, peer),
                                      &positions[peer], sizeof(int64_t)));
  }
  for (int peer = 0; peer < world_size; ++peer) {
    if (peer == self) continue;
    requests.push_back(world.PostSend(self, peer, MakeControlTag(control_seq, 0, self),
                                      &positions[self], sizeof(int64_t)));
  }
  const std::string context = std::string(name) +
                              " (mesh discovery; every device of the "
                              "world must run this collective)";
  transport::Status status = world.Wait(self, requests, transport::DefaultDeadline(), context);
  if (!status.ok()) return FromStatus(status);
  table->assign(world_size, -1);
  for (int rank = 0; rank < world_size; ++rank) {
    const int64_t p = positions[rank];
    if (p < 0 || p >= world_size || (*table)[p] != -1) {
      return Fail(name, "devices disagree about the mesh layout (world rank " +
                            std::to_string(rank) + " claims mesh position " + std::to_string(p) +
                            "); every rank must run the same program over the same mesh");
    }
    (*table)[p] = rank;
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error Group::Begin(const CallSite& site, std::unique_ptr<Group>* out) {
  std::unique_ptr<Group> group(new Group());
  group->start_ = std::chrono::steady_clock::now();
  group->start_cpu_ = ThreadCpuSeconds();
  group->last_mark_ = group->start_;
  group->deadline_ = transport::DefaultDeadline();
  group->name_ = site.name;
  group->world_ = transport::GetWorld(site.world_handle);
  if (!group->world_) {
    return Fail(site.name, "the jaxcomm world " + std::to_string(site.world_handle) +
                               " is not initialized in this process (was the function traced "
                               "in another process? call it again after jaxcomm initializes)");
  }
  transport::Transport& world = *group->world_;
  group->wire_ = &world;
  if (const auto& chosen = transport::SelectedTransport(site.memory); chosen.entry == nullptr) {
    return Fail(site.name, chosen.error);
  }
  const auto& devices = site.world_devices;
  const auto found = std::find(devices.begin(), devices.end(), site.device_id);
  if (found == devices.end()) {
    return Fail(site.name, "device " + std::to_string(site.device_id) + " is not in the world");
  }
  const int self = static_cast<int>(found - devices.begin());
  if (!world.IsLocal(self)) {
    return Fail(site.name, "world rank " + std::to_string(self) + " is not hosted here");
  }
  group->self_world_rank_ = self;
  group->world_handle_ = site.world_handle;
  group->world_devices_.assign(devices.begin(), devices.end());

  const int64_t axes = static_cast<int64_t>(site.mesh_axis_sizes.size());
  if (axes != site.num_coordinates || static_cast<int64_t>(site.reduce_axes.size()) != axes) {
    return Fail(site.name, "mesh attributes and coordinates disagree in length");
  }
  std::vector<int64_t> sizes(site.mesh_axis_sizes.begin(), site.mesh_axis_sizes.end());
  int64_t mesh_size = 1, position = 0;
  for (int64_t a = 0; a < axes; ++a) {
    if (site.coordinates[a] < 0 || site.coordinates[a] >= sizes[a]) {
      return Fail(site.name, "mesh coordinate out of range");
    }
    mesh_size *= sizes[a];
    position = position * sizes[a] + site.coordinates[a];
  }
  if (mesh_size != world.world_size()) {
    return Fail(site.name, "the shard_map mesh has " + std::to_string(mesh_size) +
                               " devices but the jaxcomm world has " +
                               std::to_string(world.world_size()) +
                               "; jaxcomm collectives need a mesh over all jax.devices()");
  }

  RankState* state = StateOf(site.world_handle, self);
  auto table_it = state->mesh_tables.find(sizes);
  if (table_it == state->mesh_tables.end()) {
    std::vector<int> table;
    JAXCOMM_RETURN_IF_ERROR(DiscoverMesh(world, *state, site.name, self, position, &table));
    table_it = state->mesh_tables.emplace(sizes, std::move(table)).first;
  }
  const std::vector<int>& table = table_it->second;

  // Members: mesh positions that share this device's coordinates on every non-reduced axis,
  // in row-major order of the reduced axes.
  std::vector<int64_t> coordinate(axes);
  for (int64_t p = 0; p < mesh_size; ++p) {
    int64_t rest = p;
    for (int64_t a = axes - 1; a >= 0; --a) {
      coordinate[a] = rest % sizes[a];
      rest /= sizes[a];
    }
    bool same_group = true;
    for (int64_t a = 0; a < axes; ++a) {
      if (!site.reduce_axes[a] && coordinate[a] != site.coordinates[a]) same_group = false;
    }
    if (!same_group) continue;
    if (p == position) group->rank_ = static_cast<int>(group->members_.size());
    group->members_.push_back(table[p]);
  }
  if (group->members_[group->rank_] != self) {
    return Fail(site.name,
                "this device's mesh position maps to another world rank; meshes of "
                "the same shape must order their devices identically");
  }
  group->seq_ = state->next_seq++;
  *out = std::move(group);
  return ffi::Error::Success();
}

ffi::Error Group::SendRecv(int dst, const void* send, size_t send_bytes, int src, void* recv,
                           size_t recv_capacity, size_t* received, uint32_t step) {
  // The receive goes first so that Wait() reports its length.
  Request requests[2];
  size_t count = 0;
  if (src >= 0) requests[count++] = PostRecv(src, recv, recv_capacity, step);
  if (dst >= 0) requests[count++] = PostSend(dst, send, send_bytes, step);
  return Wait(requests, count, src >= 0 ? received : nullptr);
}

transport::Request Group::PostSend(int dst, const void* data, size_t bytes, uint32_t step) {
  metrics_.bytes_sent += bytes;
  return wire_->PostSend(self_world_rank_, members_[dst], MakeTag(seq_, step, self_world_rank_),
                         data, bytes);
}

transport::Request Group::PostRecv(int src, void* data, size_t capacity, uint32_t step) {
  return wire_->PostRecv(self_world_rank_, members_[src], MakeTag(seq_, step, members_[src]), data,
                         capacity);
}

bool Group::SharesMemoryWithAll() const {
  return std::all_of(members_.begin(), members_.end(),
                     [&](int member) { return world_->SharesMemory(member); });
}

bool Group::SpansProcesses() const {
  return std::any_of(members_.begin(), members_.end(),
                     [&](int member) { return !world_->IsLocal(member); });
}

ffi::Error Group::ReadFrom(int group_rank, uint64_t address, void* dst, size_t bytes) {
  const transport::Status status =
      world_->ReadPeer(members_[group_rank], address, dst, bytes,
                       std::string(name_) + " (group rank " + std::to_string(rank_) + " of " +
                           std::to_string(size()) + ")");
  if (!status.ok()) return FromStatus(status);
  return ffi::Error::Success();
}

std::string Group::MissingLocalDevices() const {
  std::vector<int64_t> missing, started;
  for (int member : members_) {
    if (!world_->IsLocal(member)) continue;
    const uint32_t last = StateOf(world_handle_, member)->next_seq.load() - 1;
    (last < seq_ ? missing : started).push_back(world_devices_[member]);
  }
  if (missing.empty()) return "";
  const double seconds = std::chrono::duration<double>(transport::DefaultTimeout()).count();
  ffi_common::TextBuilder out;
  out << name_ << " #" << seq_ << ": device(s) " << JoinInts(missing)
      << " of this process never started it within " << seconds << " s (device(s) "
      << JoinInts(started)
      << " did). XLA:CPU had not launched their part of the step: the loop dispatched steps "
         "too far ahead of the devices. Bound the steps in flight with jaxcomm.paced (README, "
         "'Training loops without a sync per step').";
  return out.str();
}

std::string Group::Context() const {
  return std::string(name_) + " (group rank " + std::to_string(rank_) + " of " +
         std::to_string(size()) + ")";
}

ffi::Error Group::WaitOutcome(const transport::Status& status) {
  if (status.code() == transport::StatusCode::kDeadlineExceeded) {
    // A local peer that never started this collective is not a network problem: say so.
    if (std::string missing = MissingLocalDevices(); !missing.empty()) {
      return ffi::Error::Internal(StopEngine(missing));
    }
  }
  return FromStatus(status);
}

ffi::Error Group::WaitNotices(uint32_t step, std::vector<transport::Transport::Notice>* notices,
                              int only) {
  std::vector<int> waited;  // group ranks
  for (int q = 0; q < size(); ++q) {
    if (q != rank_ && (only < 0 || q == only)) waited.push_back(q);
  }
  std::vector<int> peers;
  for (int q : waited) peers.push_back(members_[q]);
  std::vector<transport::Transport::Notice> got(peers.size());
  const auto waiting = std::chrono::steady_clock::now();
  const transport::Status status = world_->WaitNotices(
      self_world_rank_, peers.data(), peers.size(), seq_, step, got.data(), deadline_, Context());
  metrics_.wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
  if (!status.ok()) return WaitOutcome(status);
  if (notices != nullptr) {
    notices->assign(size(), transport::Transport::Notice{});
    for (size_t i = 0; i < waited.size(); ++i) (*notices)[waited[i]] = got[i];
  }
  return ffi::Error::Success();
}

ffi::Error Group::Wait(transport::Request* requests, size_t count, size_t* received) {
  const auto waiting = std::chrono::steady_clock::now();
  transport::Status status = wire_->Wait(self_world_rank_, requests, count, deadline_, Context());
  metrics_.wait_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting).count();
  if (!status.ok()) return WaitOutcome(status);
  for (size_t i = 0; i < count; ++i) {
    if (requests[i].is_recv()) metrics_.bytes_received += requests[i].received_bytes();
  }
  if (received && count > 0) *received = requests[0].received_bytes();
  return ffi::Error::Success();
}

namespace {
double MonotonicSeconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}
}  // namespace

double ThreadCpuSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

void Group::MarkPhase(const char* name) {
  const auto now = std::chrono::steady_clock::now();
  metrics_.phases.emplace_back(name, std::chrono::duration<double>(now - last_mark_).count());
  last_mark_ = now;
}

void Group::Finish(const char* algorithm, int64_t elements) {
  const auto now = std::chrono::steady_clock::now();
  const double seconds = std::chrono::duration<double>(now - start_).count();
  // Off the engine (GPU handlers) the call starts where it is queued.
  const double queued_on_engine = QueuedSecondsOfCurrentCollective();
  const double queued = queued_on_engine > 0.0 ? queued_on_engine : MonotonicSeconds(start_);
  const uint64_t dense =
      metrics_.has_dense_equivalent ? metrics_.dense_bytes_sent : metrics_.bytes_sent;
  RecordMetrics({self_world_rank_, name_, algorithm, seq_, size(), elements, metrics_.bytes_sent,
                 metrics_.bytes_received, dense, seconds, queued, MonotonicSeconds(start_),
                 MonotonicSeconds(now), metrics_.wait_seconds, metrics_.reduce_seconds,
                 metrics_.copy_seconds, ThreadCpuSeconds() - start_cpu_, metrics_.phases});
}

}  // namespace jaxcomm::collectives
