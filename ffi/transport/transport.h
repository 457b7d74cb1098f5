// The transport interface under every collective: what a Group (ffi/group.h) asks of a wire.
// No UCX, NCCL or XLA types, so the FFI handlers include it and stay independent of them.
//
// A Transport is a table of operations, in the manner of NCCL's src/transport/{net,shm,p2p}.cc:
//   - messages: post a tagged send or receive (nonblocking, one virtual call each), and wait
//     for a batch with a deadline; a failed wait names the context, the tag and the peer;
//   - memory kinds: which buffers its messages may point at (host, device);
//   - same-host memory: direct reads of a peer's buffers, notices and staging areas, where an
//     implementation shares memory between the ranks of one host (shm.h);
//   - counters of completed traffic;
//   - world setup: a rank's address to publish, and the connection to every peer's.
// Implementations live in their own files and are chosen by name through one table
// (registry.h): UCX (ucx_world.h) and NCCL (ffi/cuda/nccl_transport.h); shared memory
// (shm.h) is the same-host part that the UCX one offers next to its endpoints.
//
// Ranks are world ranks. Threading: operations that name a local rank `self` may run
// concurrently for different `self` values, never for the same one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ffi/transport/shm.h"
#include "ffi/transport/status.h"

namespace jaxcomm::transport {

// ---- Tags -------------------------------------------------------------------------------
// 64-bit tag layout (receives match all 64 bits, so two collectives or two steps can never
// take each other's messages):
//   bit  63     : channel (0 = collectives via MakeTag, 1 = control/test traffic)
//   bits 62..32 : collective sequence number, 31 bits (per-rank counter; wraps mod 2^31)
//   bits 31..16 : step within the collective, 16 bits (ring step, tree level, ...)
//   bits 15..0  : source (sending) world rank, 16 bits -> worlds of up to 65536 ranks
// The destination is implicit: each local rank has its own endpoint set.
inline constexpr int kTagSrcBits = 16;
inline constexpr int kTagStepBits = 16;
inline constexpr int kTagSeqBits = 31;
inline constexpr int kMaxWorldSize = 1 << kTagSrcBits;

constexpr uint64_t MakeTag(uint32_t seq, uint32_t step, uint32_t src) {
  return ((static_cast<uint64_t>(seq) & ((1ull << kTagSeqBits) - 1)) << 32) |
         ((static_cast<uint64_t>(step) & ((1ull << kTagStepBits) - 1)) << kTagSrcBits) |
         (static_cast<uint64_t>(src) & ((1ull << kTagSrcBits) - 1));
}
// Same layout on the control channel (bootstrap checks, tests, tools): never matches MakeTag.
constexpr uint64_t MakeControlTag(uint32_t seq, uint32_t step, uint32_t src) {
  return MakeTag(seq, step, src) | (1ull << 63);
}
constexpr uint32_t TagSeq(uint64_t tag) {
  return static_cast<uint32_t>((tag >> 32) & ((1ull << kTagSeqBits) - 1));
}
constexpr uint32_t TagStep(uint64_t tag) {
  return static_cast<uint32_t>((tag >> kTagSrcBits) & ((1ull << kTagStepBits) - 1));
}
constexpr uint32_t TagSource(uint64_t tag) {
  return static_cast<uint32_t>(tag & ((1ull << kTagSrcBits) - 1));
}
constexpr bool TagIsControl(uint64_t tag) { return (tag >> 63) != 0; }
// "seq 5 step 2 src 1" (with "control " in front on the control channel), for messages.
std::string DescribeTag(uint64_t tag);

// Per-local-rank traffic counters (completed operations only).
struct Counters {
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t messages_sent = 0;
  uint64_t messages_received = 0;
};

// Where a message's buffer lives; a transport accepts a set of them (Transport::Accepts).
enum class MemoryKind : uint8_t {
  kHost = 1,    // CPU memory (pageable or pinned)
  kDevice = 2,  // GPU memory of the calling rank's device
};

class Transport;

// A posted send or receive. Move-only; complete it with Transport::Wait. Destroying a request
// that is still pending hands it back to its transport (Transport::Release: a receive is
// cancelled, a send left to finish); the caller's buffer must then stay valid until the
// transport is destroyed, so do not rely on that: always Wait.
class Request {
 public:
  Request() = default;
  Request(Request&& other) noexcept { *this = std::move(other); }
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { Abandon(); }

  bool is_send() const { return state_.kind == Kind::kSend; }
  bool is_recv() const { return state_.kind == Kind::kRecv; }
  int peer() const { return state_.peer; }
  uint64_t tag() const { return state_.tag; }
  // Bytes actually received (<= capacity); valid after a successful Wait.
  size_t received_bytes() const { return state_.received; }

  enum class Kind : uint8_t { kNone, kSend, kRecv };
  // What a transport keeps per request (only implementations touch it: Transport::StateOf).
  struct State {
    Kind kind = Kind::kNone;
    int self = -1;
    int peer = -1;
    uint64_t tag = 0;
    size_t bytes = 0;     // send size or receive capacity
    size_t received = 0;  // receive length once done
    bool done = true;
    int code = 0;                // the implementation's status of the completed operation
    void* pending = nullptr;     // the implementation's handle while not done
    Transport* owner = nullptr;  // who releases `pending`
    std::string error;           // set when posting failed (reported by Wait)
  };

 private:
  friend class Transport;
  void Abandon();
  State state_;
};

class Transport {
 public:
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // The registered name (registry.h): "ucx", "nccl".
  virtual const char* name() const = 0;
  // Whether messages may point at memory of `kind`.
  virtual bool Accepts(MemoryKind kind) const = 0;

  int world_size() const { return world_size_; }
  const std::vector<int>& local_ranks() const { return local_ranks_; }
  bool IsLocal(int rank) const { return LocalIndex(rank) >= 0; }

  // ---- World setup ----------------------------------------------------------------------
  // Opaque bytes local rank `rank` publishes to its peers; empty if `rank` is not local or
  // the transport is not set up through the world (NCCL bootstraps per group).
  virtual std::string Address(int rank) const = 0;
  // Connects every local rank to every world rank from Address(r) of every rank r, gathered
  // from all processes. Call once. Returns false with *error set on failure.
  virtual bool Connect(const std::vector<std::string>& addresses_by_world_rank,
                       std::string* error) = 0;
  // How the transport waits ("wakeup" or "backoff" for UCX), for diagnostics.
  virtual const char* wait_mode_name() const = 0;

  // ---- Messages -------------------------------------------------------------------------
  // Posts a tagged send of `bytes` from `data` (kept alive and unchanged by the caller until
  // the request completes) from local rank `self` to world rank `peer`. TagSource(tag) must be
  // `self`. Posting errors are reported by Wait.
  virtual Request PostSend(int self, int peer, uint64_t tag, const void* data, size_t bytes) = 0;
  // Posts a receive of at most `capacity` bytes with exactly `tag` (TagSource(tag) == peer).
  // The message may be shorter than `capacity`; longer is an error (truncation).
  virtual Request PostRecv(int self, int peer, uint64_t tag, void* data, size_t capacity) = 0;
  // Waits until all `requests` of local rank `self` completed, the deadline passed or a peer
  // failed. On failure the message names `context`, the operation, the tag's seq/step and the
  // peer; the remaining requests are cancelled. A stream-ordered transport (NCCL) completes
  // here once the operations are enqueued; its failures surface through its own watchdog.
  virtual Status Wait(int self, Request* requests, size_t count, Deadline deadline,
                      std::string_view context) = 0;
  Status Wait(int self, std::vector<Request>& requests, Deadline deadline,
              std::string_view context) {
    return Wait(self, requests.data(), requests.size(), deadline, context);
  }
  // Blocking forms over PostSend/PostRecv/Wait. One ring step: send to `send_peer` while
  // receiving from `recv_peer`.
  Status SendRecv(int self, int send_peer, uint64_t send_tag, const void* send_data,
                  size_t send_bytes, int recv_peer, uint64_t recv_tag, void* recv_data,
                  size_t recv_capacity, size_t* received, Deadline deadline,
                  std::string_view context);
  Status Send(int self, int peer, uint64_t tag, const void* data, size_t bytes, Deadline deadline,
              std::string_view context);
  Status Recv(int self, int peer, uint64_t tag, void* data, size_t capacity, size_t* received,
              Deadline deadline, std::string_view context);

  // Traffic of local rank `self` (zeros if not local).
  virtual Counters GetCounters(int self) const = 0;

  // ---- Same-host memory (shm.h), where the implementation offers it ------------------------
  // True when this process can read world rank `peer`'s memory with ReadPeer.
  bool SharesMemory(int peer) const { return memory_ != nullptr && memory_->Shares(peer); }
  // The address of `pointer` as peers see it (pass it to them; they give it to ReadPeer).
  static uint64_t AddressOf(const void* pointer) { return reinterpret_cast<uintptr_t>(pointer); }
  // `address` of world rank `peer` as a pointer when the peer is in this process, else null
  // (then read it with ReadPeer).
  const void* LocalPointer(int peer, uint64_t address) const {
    return IsLocal(peer) ? reinterpret_cast<const void*>(static_cast<uintptr_t>(address)) : nullptr;
  }
  // SharedMemory::Read: `bytes` at `address` in world rank `peer`'s memory into `dst`.
  Status ReadPeer(int peer, uint64_t address, void* dst, size_t bytes,
                  std::string_view context) const {
    return memory_->Read(peer, address, dst, bytes, context);
  }
  // Notices (SharedMemory::Post and Wait): what a rank tells its group in a shared-memory
  // collective, kept apart for kNoticeSeqs collectives in a row.
  using Notice = SharedMemory::Notice;
  static constexpr uint32_t kNoticeSeqs = SharedMemory::kNoticeSeqs;
  void PostNotice(int self, uint32_t seq, uint32_t step, const Notice* notice) {
    memory_->Post(self, seq, step, notice);
  }
  Status WaitNotices(int self, const int* peers, size_t count, uint32_t seq, uint32_t step,
                     Notice* notices, Deadline deadline, std::string_view context) {
    return memory_->Wait(self, peers, count, seq, step, notices, deadline, context);
  }
  // Staging areas (SharedMemory::StagingArea): world rank `rank`'s area for collective `seq`,
  // or null.
  static constexpr uint32_t kStagingAreas = SharedMemory::kStagingAreas;
  static constexpr size_t kStagingBytes = SharedMemory::kStagingBytes;
  void* StagingArea(int rank, uint32_t seq) const {
    return memory_ ? memory_->StagingArea(rank, seq) : nullptr;
  }

 protected:
  Transport() = default;
  // Sets the world this transport serves: its size and the world ranks hosted here (distinct,
  // in [0, world_size)). Returns "" or what is wrong with them.
  std::string SetRanks(int world_size, std::vector<int> local_ranks);
  // Index of world rank `rank` in local_ranks(), or -1.
  int LocalIndex(int rank) const {
    return rank >= 0 && rank < world_size_ ? local_index_of_rank_[rank] : -1;
  }
  const std::vector<int>& local_index_of_rank() const { return local_index_of_rank_; }
  // The same-host memory this transport offers (owned by the implementation), or null.
  void set_memory(SharedMemory* memory) { memory_ = memory; }

  // A request's state, for implementations.
  static Request::State& StateOf(Request& request) { return request.state_; }
  static const Request::State& StateOf(const Request& request) { return request.state_; }
  // Describes the new request `r` as this transport's message of `kind`: `bytes` (a send's
  // size or a receive's capacity) between local rank `self` and `peer`, under `tag`.
  void Describe(Request::State& r, Request::Kind kind, int self, int peer, uint64_t tag,
                size_t bytes) {
    r.kind = kind;
    r.self = self;
    r.peer = peer;
    r.tag = tag;
    r.bytes = bytes;
    r.owner = this;
  }
  // Hands back a request still pending (state.pending != null) whose owner drops it: cancel a
  // receive, let a send finish; then clear `pending` and mark it done.
  virtual void Release(Request::State& state) = 0;

 private:
  friend class Request;
  int world_size_ = 0;
  std::vector<int> local_ranks_;
  std::vector<int> local_index_of_rank_;  // world rank -> index into local_ranks_, or -1
  SharedMemory* memory_ = nullptr;
};

}  // namespace jaxcomm::transport
