// UCX transport: see ucx_world.h for the model. Implementation notes:
// - One ucp_context (tag matching, optional wakeup) per world; one worker per local rank in
//   UCS_THREAD_MODE_SERIALIZED, because XLA may run a rank's successive handler calls on
//   different OS threads, but never two at once for one rank.
// - Endpoints to ranks in other processes use UCP_ERR_HANDLING_MODE_PEER so a dead peer fails
//   the waits (UCX then only selects transports that can detect peer failure: tcp here).
//   Endpoints to ranks of this process cannot lose their peer alone, so they keep the default
//   mode, which lets UCX use shared memory (sysv/posix + cma, or self).
// - Requests are polled with ucp_request_check_status, so no completion callbacks (and no
//   per-request state inside UCX's request memory) are needed.
#include "ffi/transport/ucx_world.h"

#include <poll.h>
#include <sched.h>
#include <time.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <set>
#include <utility>

namespace jaxcomm::transport {

namespace {

// Longest single sleep in poll()/nanosleep: bounds how late we notice a deadline and how often
// keepalive/error handling gets progressed while a rank is blocked.
constexpr int kMaxPollMs = 100;
constexpr int64_t kMaxBackoffNs = 1000000;  // 1 ms
// How long a failed wait keeps progressing to let cancelled requests complete.
constexpr auto kCancelGrace = std::chrono::milliseconds(1000);
// How long teardown lets endpoints flush before the workers are destroyed anyway.
constexpr auto kCloseGrace = std::chrono::milliseconds(2000);

std::string UcsError(ucs_status_t status) {
  return std::string(ucs_status_string(status)) + " (" + std::to_string(status) + ")";
}

void SleepNs(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  nanosleep(&ts, nullptr);
}

}  // namespace

// ---- UCX state ---------------------------------------------------------------------------

struct PeerLink {
  int peer = -1;
  ucp_ep_h ep = nullptr;
  bool same_process = false;
  // Set by the endpoint error callback (runs inside ucp_worker_progress of the owning worker).
  std::atomic<int> failure{UCS_OK};
};

struct LocalRank {
  int rank = -1;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::unique_ptr<PeerLink[]> links;  // by world rank; stable addresses for the callbacks
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, messages_sent{0}, messages_received{0};
};

struct UcxWorld::Impl {
  ucp_context_h context = nullptr;
  WaitMode mode = WaitMode::kWakeup;
  int64_t spin_ns = 0;
  std::vector<std::unique_ptr<LocalRank>> locals;  // parallel to local_ranks()
};

namespace {

void OnEndpointError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* link = static_cast<PeerLink*>(arg);
  int expected = UCS_OK;
  link->failure.compare_exchange_strong(expected, status);
}

// Progresses `worker` until `request` completed or `until` passed; true if it completed.
bool ProgressUntilDone(ucp_worker_h worker, void* request, Deadline until) {
  while (ucp_request_check_status(request) == UCS_INPROGRESS) {
    if (Clock::now() >= until) return false;
    if (ucp_worker_progress(worker) == 0) SleepNs(20000);
  }
  return true;
}

}  // namespace

// ---- Requests ----------------------------------------------------------------------------

namespace {

// Files what UCX's `call` (ucp_tag_send_nbx or ucp_tag_recv_nbx) returned into `r`: done in
// place (returns true: the caller counts the traffic), failed, or pending on a UCX request.
bool Posted(Request::State& r, void* ucp_result, const char* call) {
  if (ucp_result == nullptr) {  // completed in place
    r.code = UCS_OK;
    return true;
  }
  if (UCS_PTR_IS_ERR(ucp_result)) {
    r.code = UCS_PTR_STATUS(ucp_result);
    r.error = std::string(call) + ": " + UcsError(UCS_PTR_STATUS(ucp_result));
  } else {
    r.pending = ucp_result;
    r.done = false;
  }
  return false;
}

}  // namespace

void UcxWorld::Release(Request::State& r) {
  // A receive still pending would write into a buffer its owner is about to drop: cancel it.
  // Either way UCX frees the request object once the operation finished.
  if (r.kind == Request::Kind::kRecv && ucp_request_check_status(r.pending) == UCS_INPROGRESS) {
    const int index = LocalIndex(r.self);
    if (index >= 0) ucp_request_cancel(impl_->locals[index]->worker, r.pending);
  }
  ucp_request_free(r.pending);
  r.pending = nullptr;
  r.done = true;
}

// ---- UcxWorld ----------------------------------------------------------------------------

const char* UcxWorld::wait_mode_name() const {
  return WaitModeName(impl_ ? impl_->mode : WaitMode::kWakeup);
}

std::unique_ptr<UcxWorld> UcxWorld::Create(int world_size, std::vector<int> local_ranks,
                                           std::string* error) {
  auto fail = [&](std::string message) -> std::unique_ptr<UcxWorld> {
    if (error) *error = "jaxcomm UcxWorld::Create: " + std::move(message);
    return nullptr;
  };
  std::unique_ptr<UcxWorld> world(new UcxWorld());
  if (std::string bad = world->SetRanks(world_size, std::move(local_ranks)); !bad.empty()) {
    return fail(bad);
  }
  world->impl_ = std::make_unique<Impl>();
  Impl& impl = *world->impl_;

  // Wait strategy (see Wait) and how long a wait spins: env JAXCOMM_UCX_WAIT and
  // JAXCOMM_UCX_SPIN_US. JAXCOMM_TIMEOUT_S is read by DefaultTimeout(); all are checked here
  // so that a bad value fails early.
  if (std::string bad = CheckWorldSettings(); !bad.empty()) return fail(bad);
  ReadWaitMode(&impl.mode);
  impl.spin_ns = static_cast<int64_t>(ValueOrFallback(kSpinMicroseconds) * 1000);

  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return fail("ucp_config_read: " + UcsError(status));
  // Cross-process endpoints run over tcp (see the notes above). Its default 8 KiB segments
  // left large messages well short of what 256 KiB segments reach over loopback. A user's own
  // UCX_TCP_*_SEG_SIZE wins.
  for (const char* name : {"TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"}) {
    if (std::getenv((std::string("UCX_") + name).c_str()) == nullptr) {
      ucp_config_modify(config, name, "256k");  // best effort: ignore if unknown
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_ESTIMATED_NUM_EPS | UCP_PARAM_FIELD_ESTIMATED_NUM_PPN |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG;
  if (impl.mode == WaitMode::kWakeup) params.features |= UCP_FEATURE_WAKEUP;
  // Workers of one context are driven by different threads concurrently.
  params.mt_workers_shared = 1;
  params.estimated_num_eps = static_cast<size_t>(world_size);
  params.estimated_num_ppn = world->local_ranks().size();
  params.name = "jaxcomm";
  status = ucp_init(&params, config, &impl.context);
  ucp_config_release(config);
  if (status != UCS_OK) return fail("ucp_init: " + UcsError(status));

  for (int rank : world->local_ranks()) {
    auto local = std::make_unique<LocalRank>();
    local->rank = rank;
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    status = ucp_worker_create(impl.context, &wparams, &local->worker);
    if (status != UCS_OK) {
      return fail("ucp_worker_create for rank " + std::to_string(rank) + ": " + UcsError(status));
    }
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    impl.locals.push_back(std::move(local));  // owned now: destroyed by ~UcxWorld on failure
    LocalRank& l = *impl.locals.back();
    if (ucp_worker_query(l.worker, &attr) == UCS_OK && attr.thread_mode == UCS_THREAD_MODE_SINGLE) {
      return fail("UCX gave a single-threaded worker; a multi-thread UCX build is needed");
    }
    if (impl.mode == WaitMode::kWakeup) {
      status = ucp_worker_get_efd(l.worker, &l.efd);
      if (status != UCS_OK) return fail("ucp_worker_get_efd: " + UcsError(status));
    }
  }
  // Shared memory (shm.h). Without a notice segment nothing is shared: Connect then leaves
  // every shared-memory path off.
  world->shm_ = std::make_unique<SharedMemory>(world->local_index_of_rank(), impl.spin_ns);
  world->set_memory(world->shm_.get());
  return world;
}

UcxWorld::~UcxWorld() {
  if (!impl_) return;
  Impl& impl = *impl_;
  // Close every endpoint: flush mode where the link is healthy (so eager data still buffered
  // inside UCX reaches the peer), force mode where it failed. Progress all local workers
  // together because in-process endpoints need both sides to move.
  std::vector<std::pair<ucp_worker_h, void*>> closing;
  for (auto& local : impl.locals) {
    if (!local->links) continue;
    for (int r = 0; r < world_size(); ++r) {
      PeerLink& link = local->links[r];
      if (link.ep == nullptr) continue;
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = link.failure.load() != UCS_OK ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      void* req = ucp_ep_close_nbx(link.ep, &p);
      link.ep = nullptr;
      if (req != nullptr && !UCS_PTR_IS_ERR(req)) closing.emplace_back(local->worker, req);
    }
  }
  Deadline until = Clock::now() + kCloseGrace;
  while (!closing.empty()) {
    unsigned progressed = 0;
    for (auto& local : impl.locals) progressed += ucp_worker_progress(local->worker);
    closing.erase(std::remove_if(closing.begin(), closing.end(),
                                 [](const std::pair<ucp_worker_h, void*>& c) {
                                   if (ucp_request_check_status(c.second) == UCS_INPROGRESS) {
                                     return false;
                                   }
                                   ucp_request_free(c.second);
                                   return true;
                                 }),
                  closing.end());
    if (Clock::now() >= until) break;
    if (progressed == 0) SleepNs(50000);
  }
  // Endpoints that did not finish closing in time (a peer that stopped progressing) are
  // released by ucp_worker_destroy.
  for (auto& c : closing) ucp_request_free(c.second);
  for (auto& local : impl.locals) {
    if (local->worker != nullptr) ucp_worker_destroy(local->worker);
  }
  if (impl.context != nullptr) ucp_cleanup(impl.context);
}

std::string UcxWorld::Address(int rank) const {
  int index = LocalIndex(rank);
  if (index < 0) return {};
  ucp_address_t* address = nullptr;
  size_t length = 0;
  if (ucp_worker_get_address(impl_->locals[index]->worker, &address, &length) != UCS_OK) {
    return {};
  }
  std::string bytes(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(impl_->locals[index]->worker, address);
  shm_->AppendTrailer(static_cast<size_t>(index), &bytes);
  return bytes;
}

bool UcxWorld::Connect(const std::vector<std::string>& addresses, std::string* error) {
  auto fail = [&](std::string message) {
    if (error) *error = "jaxcomm UcxWorld::Connect: " + std::move(message);
    return false;
  };
  if (connected_) return fail("already connected");
  if (static_cast<int>(addresses.size()) != world_size()) {
    return fail("got " + std::to_string(addresses.size()) + " addresses for a world of " +
                std::to_string(world_size()) + " ranks");
  }
  for (int r = 0; r < world_size(); ++r) {
    if (addresses[r].empty()) return fail("empty address for rank " + std::to_string(r));
  }
  // Split each address into UCX's part and the shared-memory trailer (Address()); decide which
  // ranks' memory this process can read.
  std::vector<std::string> ucx_addresses(addresses);
  if (std::string bad = shm_->Connect(&ucx_addresses); !bad.empty()) return fail(bad);
  for (auto& local : impl_->locals) {
    local->links.reset(new PeerLink[world_size()]);
    for (int r = 0; r < world_size(); ++r) {
      PeerLink& link = local->links[r];
      link.peer = r;
      link.same_process = IsLocal(r);
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(ucx_addresses[r].data());
      ep.err_mode = link.same_process ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = OnEndpointError;
      ep.err_handler.arg = &link;
      ucs_status_t status = ucp_ep_create(local->worker, &ep, &link.ep);
      if (status != UCS_OK) {
        link.ep = nullptr;
        return fail("ucp_ep_create from rank " + std::to_string(local->rank) + " to rank " +
                    std::to_string(r) + ": " + UcsError(status));
      }
    }
  }
  connected_ = true;
  return true;
}

Counters UcxWorld::GetCounters(int self) const {
  Counters c;
  int index = LocalIndex(self);
  if (index < 0) return c;
  const LocalRank& l = *impl_->locals[index];
  c.bytes_sent = l.bytes_sent.load(std::memory_order_relaxed);
  c.bytes_received = l.bytes_received.load(std::memory_order_relaxed);
  c.messages_sent = l.messages_sent.load(std::memory_order_relaxed);
  c.messages_received = l.messages_received.load(std::memory_order_relaxed);
  return c;
}

LocalRank* UcxWorld::StartRequest(Request::State& r, Request::Kind kind, int self, int peer,
                                  uint64_t tag, size_t bytes) {
  Describe(r, kind, self, peer, tag, bytes);
  const int index = LocalIndex(self);
  if (index < 0 || peer < 0 || peer >= world_size() || !connected_) {
    r.code = UCS_ERR_INVALID_PARAM;
    r.error = !connected_ ? "world not connected"
                          : "invalid self " + std::to_string(self) + " (local?) or peer " +
                                std::to_string(peer);
    return nullptr;
  }
  // A send is tagged with its own rank, a receive with the peer it expects.
  const bool send = r.kind == Request::Kind::kSend;
  const int source = send ? self : peer;
  if (TagSource(tag) != static_cast<uint32_t>(source % kMaxWorldSize)) {
    r.code = UCS_ERR_INVALID_PARAM;
    r.error = std::string(send ? "send tag source " : "receive tag source ") +
              std::to_string(TagSource(tag)) + (send ? " is not self" : " is not the peer");
    return nullptr;
  }
  return impl_->locals[index].get();
}

Request UcxWorld::PostSend(int self, int peer, uint64_t tag, const void* data, size_t bytes) {
  Request request;
  Request::State& r = StateOf(request);
  LocalRank* l = StartRequest(r, Request::Kind::kSend, self, peer, tag, bytes);
  if (l == nullptr) return request;
  PeerLink& link = l->links[peer];
  if (int f = link.failure.load(); f != UCS_OK || link.ep == nullptr) {
    r.code = f != UCS_OK ? f : UCS_ERR_CANCELED;
    r.error = "link to peer already failed: " + UcsError(static_cast<ucs_status_t>(r.code));
    return request;
  }
  ucp_request_param_t p{};
  if (Posted(r, ucp_tag_send_nbx(link.ep, data, bytes, tag, &p), "ucp_tag_send_nbx")) {
    l->bytes_sent.fetch_add(bytes, std::memory_order_relaxed);
    l->messages_sent.fetch_add(1, std::memory_order_relaxed);
  }
  return request;
}

Request UcxWorld::PostRecv(int self, int peer, uint64_t tag, void* data, size_t capacity) {
  Request request;
  Request::State& r = StateOf(request);
  LocalRank* l = StartRequest(r, Request::Kind::kRecv, self, peer, tag, capacity);
  if (l == nullptr) return request;
  ucp_tag_recv_info_t info{};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
  p.recv_info.tag_info = &info;
  // Full 64-bit mask: seq, step and source must all match.
  if (Posted(r, ucp_tag_recv_nbx(l->worker, data, capacity, tag, ~uint64_t{0}, &p),
             "ucp_tag_recv_nbx")) {
    r.received = info.length;
    l->bytes_received.fetch_add(info.length, std::memory_order_relaxed);
    l->messages_received.fetch_add(1, std::memory_order_relaxed);
  }
  return request;
}

Status UcxWorld::Wait(int self, Request* requests, size_t count, Deadline deadline,
                      std::string_view context) {
  int index = LocalIndex(self);
  auto describe = [&](const Request::State& r) {
    return std::string((r.kind == Request::Kind::kSend) ? "send to" : "receive from") + " rank " +
           std::to_string(r.peer) + " (" + DescribeTag(r.tag) + ") on rank " + std::to_string(self);
  };
  if (index < 0) {
    return Status(StatusCode::kInvalidArgument,
                  std::string(context) + ": rank " + std::to_string(self) + " is not local");
  }
  LocalRank& l = *impl_->locals[index];
  const Impl& impl = *impl_;

  // Completes request `r` if UCX finished it; returns whether it is done.
  auto poll_request = [&](Request::State& r) {
    if (r.done) return true;
    ucs_status_t st = ucp_request_check_status(r.pending);
    if (st == UCS_INPROGRESS) return false;
    if ((r.kind == Request::Kind::kRecv) && st == UCS_OK) {
      ucp_tag_recv_info_t info{};
      ucp_tag_recv_request_test(r.pending, &info);
      r.received = info.length;
      l.bytes_received.fetch_add(info.length, std::memory_order_relaxed);
      l.messages_received.fetch_add(1, std::memory_order_relaxed);
    } else if ((r.kind == Request::Kind::kSend) && st == UCS_OK) {
      l.bytes_sent.fetch_add(r.bytes, std::memory_order_relaxed);
      l.messages_sent.fetch_add(1, std::memory_order_relaxed);
    }
    ucp_request_free(r.pending);
    r.pending = nullptr;
    r.code = st;
    r.done = true;
    return true;
  };

  Status error;
  Deadline idle_since = Clock::now();
  int64_t backoff_ns = 1000;
  for (;;) {
    size_t pending = 0;
    for (size_t i = 0; i < count && error.ok(); ++i) {
      Request::State& r = StateOf(requests[i]);
      if (!poll_request(r)) {
        ++pending;
        // A receive is not bound to an endpoint, so UCX cannot fail it when the sender dies:
        // check the link's error flag ourselves (sends to that peer fail inside UCX).
        int f = l.links ? l.links[r.peer].failure.load() : UCS_OK;
        if (f != UCS_OK) {
          error =
              Status(StatusCode::kPeerFailed,
                     std::string(context) + ": peer rank " + std::to_string(r.peer) + " failed (" +
                         UcsError(static_cast<ucs_status_t>(f)) + ") during " + describe(r));
        }
      } else if (r.code != UCS_OK) {
        auto st = static_cast<ucs_status_t>(r.code);
        bool peer_down = st == UCS_ERR_CONNECTION_RESET || st == UCS_ERR_ENDPOINT_TIMEOUT ||
                         st == UCS_ERR_UNREACHABLE || st == UCS_ERR_CANCELED;
        std::string what = !r.error.empty() ? r.error : UcsError(st);
        if (st == UCS_ERR_MESSAGE_TRUNCATED) {
          what =
              "message longer than the receive capacity of " + std::to_string(r.bytes) + " bytes";
        }
        StatusCode code = peer_down                     ? StatusCode::kPeerFailed
                          : st == UCS_ERR_INVALID_PARAM ? StatusCode::kInvalidArgument
                                                        : StatusCode::kInternal;
        error = Status(code, std::string(context) + ": " + describe(r) + " failed: " + what +
                                 (peer_down ? " (peer rank " + std::to_string(r.peer) + " failed)"
                                            : std::string()));
      }
    }
    if (error.ok() && pending > 0 && l.links) {
      // A dead peer anywhere in the world dooms this program too, even while this rank waits
      // on a live one (a ring rank only hears from its left neighbour, who may be waiting on
      // the dead one): fail now and name the dead peer, not the neighbour that went quiet.
      for (int peer = 0; peer < world_size() && error.ok(); ++peer) {
        if (int f = l.links[peer].failure.load(); f != UCS_OK) {
          error = Status(StatusCode::kPeerFailed, std::string(context) + ": peer rank " +
                                                      std::to_string(peer) + " failed (" +
                                                      UcsError(static_cast<ucs_status_t>(f)) +
                                                      ") on rank " + std::to_string(self));
        }
      }
    }
    if (!error.ok()) break;
    if (pending == 0) return Status::Ok();

    Deadline now = Clock::now();
    if (now >= deadline) {
      std::string which;
      std::set<int> peers;
      for (size_t i = 0; i < count; ++i) {
        const Request::State& r = StateOf(requests[i]);
        if (r.done) continue;
        if (which.empty()) which = describe(r);
        peers.insert(r.peer);
      }
      std::string peer_list;
      for (int p : peers) peer_list += (peer_list.empty() ? "" : ", ") + std::to_string(p);
      error = Status(StatusCode::kDeadlineExceeded,
                     std::string(context) + ": deadline exceeded waiting for " + which + "; " +
                         std::to_string(pending) + " of " + std::to_string(count) +
                         " requests pending, waiting on peer rank(s) " + peer_list +
                         " (default timeout: env JAXCOMM_TIMEOUT_S)");
      break;
    }
    if (ucp_worker_progress(l.worker) != 0) {
      idle_since = now;
      backoff_ns = 1000;
      continue;
    }
    // Idle. Spin (with yields, so other ranks on the 2 cores still run) for a short while to
    // keep the latency of back-to-back messages low, then sleep.
    int64_t idle_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(now - idle_since).count();
    if (idle_ns < impl.spin_ns) {
      sched_yield();
      continue;
    }
    int64_t remaining_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count();
    if (impl.mode == WaitMode::kWakeup) {
      ucs_status_t st = ucp_worker_arm(l.worker);
      if (st == UCS_ERR_BUSY) continue;  // events arrived meanwhile: progress again
      if (st == UCS_OK) {
        pollfd pfd{l.efd, POLLIN, 0};
        int ms = static_cast<int>(std::min<int64_t>(kMaxPollMs, remaining_ns / 1000000 + 1));
        poll(&pfd, 1, ms);
        continue;
      }
      // Arming failed (transport without wakeup support): fall through to a backoff sleep.
    }
    SleepNs(std::min(backoff_ns, remaining_ns + 1));
    backoff_ns = std::min(backoff_ns * 2, kMaxBackoffNs);
  }

  // Failure: cancel what is still pending so no buffer of the caller stays referenced.
  std::set<int> stuck_send_peers;
  for (size_t i = 0; i < count; ++i) {
    Request::State& r = StateOf(requests[i]);
    if (!r.done && r.pending != nullptr) ucp_request_cancel(l.worker, r.pending);
  }
  auto drain = [&](Deadline until) {
    bool all = false;
    while (!all) {
      all = true;
      for (size_t i = 0; i < count; ++i) all = poll_request(StateOf(requests[i])) && all;
      if (all || Clock::now() >= until) break;
      if (ucp_worker_progress(l.worker) == 0) SleepNs(20000);
    }
    return all;
  };
  if (!drain(Clock::now() + kCancelGrace)) {
    // Sends UCX could not cancel (e.g. rendezvous waiting for a receiver that never comes):
    // force-close those endpoints, which completes their requests with an error.
    for (size_t i = 0; i < count; ++i) {
      Request::State& r = StateOf(requests[i]);
      if (r.done || !(r.kind == Request::Kind::kSend)) continue;
      PeerLink& link = l.links[r.peer];
      if (link.ep == nullptr) continue;
      int expected = UCS_OK;
      link.failure.compare_exchange_strong(expected, UCS_ERR_CANCELED);
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      void* req = ucp_ep_close_nbx(link.ep, &p);
      link.ep = nullptr;
      if (req != nullptr && !UCS_PTR_IS_ERR(req)) {
        ProgressUntilDone(l.worker, req, Clock::now() + kCancelGrace);
        ucp_request_free(req);
      }
    }
    drain(Clock::now() + kCancelGrace);
  }
  for (size_t i = 0; i < count; ++i) {
    Request::State& r = StateOf(requests[i]);
    if (r.pending != nullptr) Release(r);  // last resort: UCX frees it later
  }
  return error;
}

}  // namespace jaxcomm::transport
