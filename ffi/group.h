// A rank's view of one collective call: who is in its group, in which order, and the tagged,
// deadline-bounded point-to-point operations the algorithms use.
//
// Group discovery. Inside shard_map a device program knows only the abstract mesh (axis
// sizes) and its own coordinates; the handler also knows its device id (DeviceOrdinal, the
// global device id on CPU). The first collective over a mesh shape exchanges (world rank,
// coordinates) among all world ranks once (control channel); afterwards every call maps its
// coordinates to the world ranks of its group locally.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ffi/transport/transport.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

namespace ffi = xla::ffi;

// Where the call sits: attributes and operands every collective handler binds.
struct CallSite {
  const char* name;                        // Python API name, for errors and metrics
  int64_t world_handle;                    // jaxcomm/_world.py's world
  int64_t device_id;                       // Ctx<DeviceOrdinal>
  ffi::Span<const int64_t> world_devices;  // device ids in world-rank order
  ffi::Span<const int64_t> mesh_axis_sizes;
  ffi::Span<const int64_t> reduce_axes;  // 1 = reduced over
  const int32_t* coordinates;            // this device's coordinate per mesh axis
  int64_t num_coordinates;
  // Where the collective's buffers live: the transport that moves them is chosen for this kind
  // (ffi/transport/registry.h, SelectedTransport).
  transport::MemoryKind memory = transport::MemoryKind::kHost;
};

// Per-call bytes and time, accumulated by Group and recorded by Finish().
struct CallMetrics {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  // What a dense float32 schedule would have sent, for compressed collectives (the compression
  // ratio is dense_bytes_sent / bytes_sent); dense collectives leave it unset (= bytes_sent).
  uint64_t dense_bytes_sent = 0;
  bool has_dense_equivalent = false;
  // Where the time went (seconds): blocked in Wait(), reducing, copying (AddTime), and per
  // algorithm phase (MarkPhase), for jaxcomm.metrics()["recent"].
  double wait_seconds = 0;
  double reduce_seconds = 0;
  double copy_seconds = 0;
  std::vector<std::pair<const char*, double>> phases;
};

// CPU time of the calling thread, seconds (a collective's cpu_seconds in the metrics).
double ThreadCpuSeconds();

// What a timed span of an algorithm did (Group::AddTime).
enum class Work { kReduce, kCopy };

class Group {
 public:
  // Resolves the group of `site` and reserves the call's sequence number. On failure returns
  // an error naming the collective.
  static ffi::Error Begin(const CallSite& site, std::unique_ptr<Group>* group);

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(members_.size()); }
  int world_rank(int group_rank) const { return members_[group_rank]; }
  uint32_t seq() const { return seq_; }
  const char* name() const { return name_; }

  // Sends to group rank `dst` while receiving from group rank `src` (either may be -1 to skip
  // that side). Messages of step `step` from `src` only; `received` gets the message length.
  ffi::Error SendRecv(int dst, const void* send, size_t send_bytes, int src, void* recv,
                      size_t recv_capacity, size_t* received, uint32_t step);
  ffi::Error Send(int dst, const void* data, size_t bytes, uint32_t step) {
    return SendRecv(dst, data, bytes, -1, nullptr, 0, nullptr, step);
  }
  ffi::Error Recv(int src, void* data, size_t capacity, size_t* received, uint32_t step) {
    return SendRecv(-1, nullptr, 0, src, data, capacity, received, step);
  }

  // Adds traffic that did not go through this Group's messages (NCCL's collectives on GPU,
  // whose sizes the algorithm knows on the host).
  void CountTraffic(uint64_t sent, uint64_t received) {
    metrics_.bytes_sent += sent;
    metrics_.bytes_received += received;
  }
  // Adds `bytes` to what a dense schedule would have sent (see CallMetrics).
  void CountDenseEquivalent(uint64_t bytes) {
    metrics_.dense_bytes_sent += bytes;
    metrics_.has_dense_equivalent = true;
  }
  // Adds the traffic of `sub` (a group this call also ran over, e.g. the intra-node group of a
  // hierarchical allreduce) to this group's metrics, so the call records one line.
  void Absorb(const Group& sub) {
    metrics_.wait_seconds += sub.metrics_.wait_seconds;
    metrics_.reduce_seconds += sub.metrics_.reduce_seconds;
    metrics_.copy_seconds += sub.metrics_.copy_seconds;
    metrics_.bytes_sent += sub.metrics_.bytes_sent;
    metrics_.bytes_received += sub.metrics_.bytes_received;
    CountDenseEquivalent(sub.metrics_.has_dense_equivalent ? sub.metrics_.dense_bytes_sent
                                                           : sub.metrics_.bytes_sent);
  }

  // The transport that moves this group's messages (ffi/transport/transport.h): the world's
  // (UCX) from Begin, until a device handler hands the group its own (UseTransport).
  transport::Transport& wire() const { return *wire_; }
  // Moves this group's later messages to `wire` (the GPU's NCCL transport over the group's
  // communicator, ffi/cuda/nccl_transport.h), which must outlive the group's use of it and
  // accept the call's memory kind. Mesh discovery and setup messages went over the world's.
  void UseTransport(transport::Transport* wire) { wire_ = wire; }

  // Nonblocking halves of SendRecv for pipelined algorithms: post, then Wait() on each
  // request (any order). Every posted request must be waited on before its buffer is reused.
  transport::Request PostSend(int dst, const void* data, size_t bytes, uint32_t step);
  transport::Request PostRecv(int src, void* data, size_t capacity, uint32_t step);
  // Waits for `count` requests; `received` (optional) gets the first request's length.
  ffi::Error Wait(transport::Request* requests, size_t count, size_t* received = nullptr);

  // Adds `seconds` spent on local work of `kind` (reduction kernels, memory copies).
  void AddTime(Work kind, double seconds) {
    (kind == Work::kReduce ? metrics_.reduce_seconds : metrics_.copy_seconds) += seconds;
  }
  // Ends the algorithm phase `name` (a string literal): its time is what passed since the
  // previous mark (or since Begin).
  void MarkPhase(const char* name);

  // Shared memory (ffi/transport/shm.h): whether this rank can read every member's
  // memory directly, a member's address as a pointer when it lives in this process (else
  // null), and a copy of `bytes` at a member's `address` into `dst` (the algorithm counts
  // what it read with CountTraffic).
  bool SharesMemoryWithAll() const;
  const void* LocalPointer(int group_rank, uint64_t address) const {
    return world_->LocalPointer(members_[group_rank], address);
  }
  ffi::Error ReadFrom(int group_rank, uint64_t address, void* dst, size_t bytes);
  // Notices among members that share memory (ffi/transport/shm.h, "Notices"): this rank reached
  // `step` of this call (with `notice`: and here are its buffers), and the wait until every
  // other member did (or only group rank `only`); `notices` (optional) gets each member's, by
  // group rank (this rank's entry zero). Waiting counts as wait time, like Wait().
  void PostNotice(uint32_t step, const transport::Transport::Notice* notice = nullptr) {
    world_->PostNotice(self_world_rank_, seq_, step, notice);
  }
  ffi::Error WaitNotices(uint32_t step, std::vector<transport::Transport::Notice>* notices,
                         int only = -1);
  // Group rank q's staging area for this call (ffi/transport/shm.h, "Staging areas"), or null, as
  // an array of T (the collective's element type).
  template <typename T = float>
  T* StagingArea(int group_rank) const {
    return static_cast<T*>(world_->StagingArea(members_[group_rank], seq_));
  }
  // Whether some member lives in another process (then reading it costs process_vm_readv).
  bool SpansProcesses() const;

  // Records this call's metrics (algorithm label, element count, bytes, wall time) in the
  // process-wide store (ffi/metrics.h).
  void Finish(const char* algorithm, int64_t elements);

 private:
  Group() = default;
  // After a deadline: a message naming the devices of this process that never started this
  // collective, or "" when every local member did.
  std::string MissingLocalDevices() const;
  // The error of a failed wait (transport status -> ffi::Error, stopping the engine).
  ffi::Error WaitOutcome(const transport::Status& status);
  // "jaxcomm.allreduce (group rank r of P)", for transport messages.
  std::string Context() const;
  int64_t world_handle_ = 0;
  std::vector<int64_t> world_devices_;           // device id of each world rank
  std::shared_ptr<transport::Transport> world_;  // bootstrap, control, same-host memory
  transport::Transport* wire_ = nullptr;         // messages (world_ unless UseTransport)
  const char* name_ = "";
  int self_world_rank_ = -1;
  int rank_ = -1;
  std::vector<int> members_;  // group rank -> world rank
  uint32_t seq_ = 0;
  transport::Deadline deadline_;
  std::chrono::steady_clock::time_point start_;
  double start_cpu_ = 0;  // ThreadCpuSeconds() at Begin
  std::chrono::steady_clock::time_point last_mark_;
  CallMetrics metrics_;
};

// Times a span of local work into group.AddTime(kind, ...) when it goes out of scope.
class TimedWork {
 public:
  TimedWork(Group& group, Work kind)
      : group_(group), kind_(kind), start_(std::chrono::steady_clock::now()) {}
  ~TimedWork() {
    group_.AddTime(
        kind_, std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count());
  }
  TimedWork(const TimedWork&) = delete;
  TimedWork& operator=(const TimedWork&) = delete;

 private:
  Group& group_;
  Work kind_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace jaxcomm::collectives
