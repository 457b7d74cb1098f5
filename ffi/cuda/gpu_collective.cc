#include "ffi/cuda/gpu_collective.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "ffi/common.h"
#include "ffi/cuda/host_staged.h"
#include "ffi/transport/settings.h"
#include "ffi/transport/transport.h"
#include "kernels/cuda_kernels.h"

namespace jaxcomm::collectives::gpu {

// A group's communicator and whether the watchdog gave up on it.
struct CommState {
  ncclComm_t comm = nullptr;
  const nccl::NcclApi* nccl = nullptr;
  std::vector<int> members;  // world ranks, in group-rank order
  std::mutex mutex;
  std::string failure;  // set once the communicator is aborted
};

namespace {

constexpr uint32_t kSetupStep = 0xfffe;  // step of the unique-id message (algorithms use none)

std::string Members(const std::vector<int>& members) {
  std::string out = "[";
  for (size_t i = 0; i < members.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(members[i]);
  }
  return out + "]";
}

// ---- process-wide tables (leaked on purpose: handlers may run during interpreter exit) ---

struct Tables {
  std::mutex mutex;
  // world handle -> world rank -> local CUDA ordinal (-1 = another process)
  std::map<int64_t, std::vector<int>> ordinals;
  // (world, ordinal, mesh axis sizes) -> this device's mesh coordinates
  std::map<std::tuple<int64_t, int, std::vector<int64_t>>, std::vector<int32_t>> coordinates;
  // (world, self world rank, members) -> communicator
  std::map<std::tuple<int64_t, int, std::vector<int>>, std::shared_ptr<CommState>> comms;
  // local CUDA ordinal -> jaxcomm's stream for split collectives on that device
  std::map<int, cudaStream_t> comm_streams;
  // first result buffer of a split start -> its results and the event after its work
  std::map<const void*, std::pair<std::vector<const void*>, cudaEvent_t>> splits;
};
Tables& tables() {
  static Tables* t = new Tables();
  return *t;
}

// ---- watchdog ----------------------------------------------------------------------------

struct Watched {
  std::shared_ptr<CommState> state;
  cudaEvent_t event;
  int device_ordinal;
  transport::Deadline deadline;
  std::string what;  // "<collective> seq S"
};

class Watchdog {
 public:
  static Watchdog& Get() {
    static Watchdog* w = new Watchdog();
    return *w;
  }
  void Add(Watched item) {
    std::lock_guard<std::mutex> lock(mutex_);
    items_.push_back(std::move(item));
    if (!started_) {
      started_ = true;
      std::thread([this] { Loop(); }).detach();
    }
  }

 private:
  void Loop() {
    for (;;) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::vector<Watched> items;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        items.swap(items_);
      }
      std::vector<Watched> pending;
      const auto now = transport::Clock::now();
      for (Watched& item : items) {
        cudaSetDevice(item.device_ordinal);
        const cudaError_t query = cudaEventQuery(item.event);
        if (query == cudaSuccess) {
          cudaEventDestroy(item.event);
          continue;
        }
        ncclResult_t async = ncclSuccess;
        item.state->nccl->comm_get_async_error(item.state->comm, &async);
        const bool failed = query != cudaErrorNotReady || async != ncclSuccess;
        if (!failed && now < item.deadline) {
          pending.push_back(std::move(item));
          continue;
        }
        std::string reason;
        if (query != cudaErrorNotReady) {
          reason = std::string("CUDA error ") + cudaGetErrorString(query);
        } else if (async != ncclSuccess) {
          reason = nccl::NcclErrorString(*item.state->nccl, "NCCL", async);
        } else {
          reason = "did not complete within " +
                   std::to_string(
                       std::chrono::duration_cast<std::chrono::seconds>(transport::DefaultTimeout())
                           .count()) +
                   " s (JAXCOMM_TIMEOUT_S): a peer is gone or stuck";
        }
        std::lock_guard<std::mutex> lock(item.state->mutex);
        if (item.state->failure.empty()) {
          item.state->failure = item.what + " over world ranks " + Members(item.state->members) +
                                ": " + reason + "; the NCCL communicator was aborted";
          item.state->nccl->comm_abort(item.state->comm);
        }
        // The event may never complete now; leak it rather than destroy a pending event.
      }
      std::lock_guard<std::mutex> lock(mutex_);
      items_.insert(items_.end(), std::make_move_iterator(pending.begin()),
                    std::make_move_iterator(pending.end()));
    }
  }

  std::mutex mutex_;
  std::vector<Watched> items_;
  bool started_ = false;
};

ffi::Error Fail(const char* name, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(name) + ": " + message);
}

// Creates the NCCL communicator of `group` (collective over its members).
ffi::Error CreateComm(Group& group, int device_ordinal, std::shared_ptr<CommState>* out) {
  std::string message;
  const nccl::NcclApi* api = nccl::LoadNccl(&message);
  if (api == nullptr) return Fail(group.name(), message);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (group.rank() == 0) {
    const ncclResult_t result = api->get_unique_id(&id);
    if (result != ncclSuccess) {
      return ffi::Error::Internal(std::string(group.name()) + ": " +
                                  nccl::NcclErrorString(*api, "ncclGetUniqueId", result));
    }
    for (int peer = 1; peer < group.size(); ++peer) {
      JAXCOMM_RETURN_IF_ERROR(group.Send(peer, &id, sizeof(id), kSetupStep));
    }
  } else {
    size_t got = 0;
    JAXCOMM_RETURN_IF_ERROR(group.Recv(0, &id, sizeof(id), &got, kSetupStep));
    if (got != sizeof(id)) return Fail(group.name(), "short NCCL unique id from group rank 0");
  }
  auto state = std::make_shared<CommState>();
  state->nccl = api;
  for (int r = 0; r < group.size(); ++r) state->members.push_back(group.world_rank(r));
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_ordinal);
  const ncclResult_t result = api->comm_init_rank(&state->comm, group.size(), id, group.rank());
  cudaSetDevice(previous);
  if (result != ncclSuccess) {
    return ffi::Error::Internal(std::string(group.name()) + ": " +
                                nccl::NcclErrorString(*api, "ncclCommInitRank", result) +
                                " (group of world ranks " + Members(state->members) + ")");
  }
  *out = std::move(state);
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CheckCuda(const char* name, cudaError_t error, const char* what) {
  if (error == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(name) + ": " + what +
                              " failed: " + cudaGetErrorString(error));
}

ffi::Error FinishSparse(GpuGroup& group, const char* op, const char* label, int64_t n,
                        const uint32_t* bad, float* out, uint64_t sent, uint64_t received,
                        cudaStream_t stream) {
  JAXCOMM_RETURN_IF_ERROR(
      CheckCuda(op, kernels::cuda::PoisonIfBad(bad, out, n, stream), "PoisonIfBad"));
  group.CountTraffic(sent, received);
  group.Finish(label, n);
  return ffi::Error::Success();
}

ffi::Error ForwardToken(cudaStream_t stream, const ffi::Buffer<ffi::S32, 0>& token,
                        ffi::ResultBuffer<ffi::S32, 0>& token_out) {
  return CheckCuda("jaxcomm collective",
                   cudaMemcpyAsync(token_out->typed_data(), token.typed_data(), sizeof(int32_t),
                                   cudaMemcpyDeviceToDevice, stream),
                   "token copy");
}

ffi::Error ResolveGpuSite(const char* name, cudaStream_t stream, const Caller& caller,
                          GpuSite* out) {
  const int32_t device_ordinal = caller.device_id;
  const ffi::Buffer<ffi::S32, 1>& coordinates = caller.coordinates;
  const CollectiveAttrs& attrs = caller.attrs;
  const int64_t world = attrs.world;
  const ffi::Span<const int64_t> world_devices = attrs.world_devices;
  Tables& t = tables();
  int self = -1;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = t.ordinals.find(world);
    if (it == t.ordinals.end()) {
      return Fail(name, "the jaxcomm GPU world " + std::to_string(world) +
                            " is not initialized in this process (was the function traced in "
                            "another process?)");
    }
    const auto& ordinals = it->second;
    const auto found = std::find(ordinals.begin(), ordinals.end(), device_ordinal);
    if (found == ordinals.end()) {
      return Fail(name, "CUDA device " + std::to_string(device_ordinal) +
                            " of this process is not in the jaxcomm GPU world");
    }
    self = static_cast<int>(found - ordinals.begin());
  }
  if (self >= static_cast<int64_t>(world_devices.size())) {
    return Fail(name, "world_devices is shorter than the GPU world");
  }
  const std::vector<int64_t> sizes(attrs.mesh_axis_sizes.begin(), attrs.mesh_axis_sizes.end());
  const auto key = std::make_tuple(world, static_cast<int>(device_ordinal), sizes);
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = t.coordinates.find(key);
    if (it != t.coordinates.end()) out->coordinates = it->second;
  }
  if (out->coordinates.empty()) {
    // First call of this device over this mesh shape: the one blocking read (file comment).
    const size_t count = coordinates.element_count();
    if (count != sizes.size()) return Fail(name, "mesh attributes and coordinates disagree");
    out->coordinates.assign(count, 0);
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(name,
                  cudaMemcpyAsync(out->coordinates.data(), coordinates.typed_data(),
                                  sizeof(int32_t) * count, cudaMemcpyDeviceToHost, stream),
                  "reading the mesh coordinates"));
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(name, cudaStreamSynchronize(stream), "reading the mesh coordinates"));
    std::lock_guard<std::mutex> lock(t.mutex);
    t.coordinates[key] = out->coordinates;
  }
  out->device_ordinal = device_ordinal;
  out->stream = stream;
  out->site = CallSite{name,
                       world,
                       world_devices[self],
                       world_devices,
                       attrs.mesh_axis_sizes,
                       attrs.reduce_axes,
                       out->coordinates.data(),
                       static_cast<int64_t>(out->coordinates.size()),
                       transport::MemoryKind::kDevice};
  return ffi::Error::Success();
}

ffi::Error BeginGpuCall(const char* name, cudaStream_t stream, const Caller& caller, GpuSite* site,
                        std::unique_ptr<GpuGroup>* group) {
  JAXCOMM_RETURN_IF_ERROR(ResolveGpuSite(name, stream, caller, site));
  return GpuGroup::Begin(*site, site->site, group);
}

ffi::Error GpuGroup::Begin(const GpuSite& gpu, const CallSite& site,
                           std::unique_ptr<GpuGroup>* out) {
  if (HostStagedSelected()) {
    return Fail(site.name,
                "JAXCOMM_TRANSPORT=ucx moves GPU buffers (host-staged) for the dense allreduce "
                "only, and this collective has no such path yet; unset JAXCOMM_TRANSPORT or set "
                "it to auto or nccl");
  }
  auto result = std::make_unique<GpuGroup>();
  JAXCOMM_RETURN_IF_ERROR(Group::Begin(site, &result->group_));
  Group& group = *result->group_;
  std::vector<int> members;
  for (int r = 0; r < group.size(); ++r) members.push_back(group.world_rank(r));
  const auto key = std::make_tuple(site.world_handle, group.world_rank(group.rank()), members);
  Tables& t = tables();
  std::shared_ptr<CommState> state;
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = t.comms.find(key);
    if (it != t.comms.end()) state = it->second;
  }
  if (!state) {
    JAXCOMM_RETURN_IF_ERROR(CreateComm(group, gpu.device_ordinal, &state));
    std::lock_guard<std::mutex> lock(t.mutex);
    t.comms[key] = state;
  }
  {
    std::lock_guard<std::mutex> lock(state->mutex);
    if (!state->failure.empty()) {
      return ffi::Error::Internal(std::string(site.name) +
                                  ": an earlier call failed: " + state->failure);
    }
  }
  result->device_ordinal_ = gpu.device_ordinal;
  result->comm_ = state->comm;
  result->nccl_ = state->nccl;
  result->wire_ = std::make_unique<nccl::NcclTransport>(*state->nccl, state->comm, state->members,
                                                        group.wire().world_size(),
                                                        group.world_rank(group.rank()), gpu.stream);
  group.UseTransport(result->wire_.get());
  result->state_ = std::move(state);
  *out = std::move(result);
  return ffi::Error::Success();
}

ffi::Error BeginSplit(const char* name, int device_ordinal, cudaStream_t xla_stream,
                      cudaStream_t* comm_stream) {
  Tables& t = tables();
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = t.comm_streams.find(device_ordinal);
    if (it != t.comm_streams.end()) *comm_stream = it->second;
  }
  if (*comm_stream == nullptr) {
    // Highest priority, so that NCCL's kernels get SMs ahead of backward's when both are ready.
    int least = 0, greatest = 0;
    JAXCOMM_RETURN_IF_ERROR(CheckCuda(name, cudaDeviceGetStreamPriorityRange(&least, &greatest),
                                      "cudaDeviceGetStreamPriorityRange"));
    cudaStream_t created = nullptr;
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(name, cudaStreamCreateWithPriority(&created, cudaStreamNonBlocking, greatest),
                  "creating jaxcomm's stream"));
    std::lock_guard<std::mutex> lock(t.mutex);
    auto [it, inserted] = t.comm_streams.emplace(device_ordinal, created);
    if (!inserted) cudaStreamDestroy(created);  // another thread made one first
    *comm_stream = it->second;
  }
  cudaEvent_t ready = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      CheckCuda(name, cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate"));
  ffi::Error error = CheckCuda(name, cudaEventRecord(ready, xla_stream), "cudaEventRecord");
  if (error.success()) {
    error = CheckCuda(name, cudaStreamWaitEvent(*comm_stream, ready, 0), "cudaStreamWaitEvent");
  }
  cudaEventDestroy(ready);  // released once the wait is satisfied
  return error;
}

ffi::Error EndSplit(const char* name, cudaStream_t comm_stream, std::vector<const void*> results) {
  if (results.empty()) return Fail(name, "a split collective needs a result buffer");
  cudaEvent_t done = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      CheckCuda(name, cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "cudaEventCreate"));
  if (ffi::Error e = CheckCuda(name, cudaEventRecord(done, comm_stream), "cudaEventRecord");
      !e.success()) {
    cudaEventDestroy(done);
    return e;
  }
  Tables& t = tables();
  std::lock_guard<std::mutex> lock(t.mutex);
  const void* key = results.front();
  if (t.splits.count(key)) {
    cudaEventDestroy(done);
    return Fail(name, "a split collective already writes this result buffer (a done is missing)");
  }
  t.splits.emplace(key, std::make_pair(std::move(results), done));
  return ffi::Error::Success();
}

ffi::Error AwaitSplit(const char* name, cudaStream_t xla_stream,
                      const std::vector<const void*>& results) {
  cudaEvent_t done = nullptr;
  {
    Tables& t = tables();
    std::lock_guard<std::mutex> lock(t.mutex);
    auto it = results.empty() ? t.splits.end() : t.splits.find(results.front());
    if (it == t.splits.end() || it->second.first != results) {
      // XLA copied a result between start and done, or done got buffers of no start.
      return Fail(name,
                  "its buffers are not those a split collective is writing (was a result "
                  "copied between start and done?)");
    }
    done = it->second.second;
    t.splits.erase(it);
  }
  ffi::Error error =
      CheckCuda(name, cudaStreamWaitEvent(xla_stream, done, 0), "cudaStreamWaitEvent");
  cudaEventDestroy(done);  // released once the wait is satisfied
  return error;
}

ffi::Error GpuGroup::Check(ncclResult_t result, const char* what) const {
  if (result == ncclSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(group_->name()) + " seq " +
                              std::to_string(group_->seq()) + ": " +
                              nccl::NcclErrorString(*nccl_, what, result));
}

ffi::Error GpuGroup::Watch(cudaStream_t stream) {
  cudaEvent_t event;
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(
      group_->name(), cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate"));
  if (ffi::Error e = CheckCuda(group_->name(), cudaEventRecord(event, stream), "cudaEventRecord");
      !e.success()) {
    cudaEventDestroy(event);
    return e;
  }
  Watchdog::Get().Add(
      Watched{state_, event, device_ordinal_, transport::DefaultDeadline(),
              std::string(group_->name()) + " seq " + std::to_string(group_->seq())});
  return ffi::Error::Success();
}

}  // namespace jaxcomm::collectives::gpu

extern "C" {

// Registers the local CUDA ordinal of each rank of GPU world `world` (ordinals[r] = the
// local_hardware_id of world rank r's device, -1 for devices of other processes).
__attribute__((visibility("default"))) int jaxcomm_gpu_world_ordinals(int64_t world,
                                                                      const int32_t* ordinals,
                                                                      int count) {
  using namespace jaxcomm::collectives::gpu;
  if (count < 1 || ordinals == nullptr) return -1;
  Tables& t = tables();
  std::lock_guard<std::mutex> lock(t.mutex);
  t.ordinals[world] = std::vector<int>(ordinals, ordinals + count);
  return 0;
}

// Names the libnccl.so.2 to load (the nvidia-nccl wheel's, found by Python); "" = soname.
__attribute__((visibility("default"))) void jaxcomm_nccl_set_library(const char* path) {
  jaxcomm::nccl::SetNcclLibrary(path ? path : "");
}

}  // extern "C"
