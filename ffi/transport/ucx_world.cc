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

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <utility>

namespace jaxcomm::transport {

namespace {

constexpr double kDefaultTimeoutSeconds = 120.0;
// Longest single sleep in poll()/nanosleep: bounds how late we notice a deadline and how often
// keepalive/error handling gets progressed while a rank is blocked.
constexpr int kMaxPollMs = 100;
constexpr int64_t kMaxBackoffNs = 1000000;  // 1 ms
// How long a failed wait keeps progressing to let cancelled requests complete.
constexpr auto kCancelGrace = std::chrono::milliseconds(1000);
// How long teardown lets endpoints flush before the workers are destroyed anyway.
constexpr auto kCloseGrace = std::chrono::milliseconds(2000);

enum class WaitMode { kWakeup, kBackoff };

// ---- Host identity (shared memory, see ucx_world.h) ---------------------------------------
// Address() appends to UCX's address: identity bytes, pid (8), probe address (8), notice
// memfd number (8), index of the rank's slots in it (8), identity length (4), kTrailerMagic (4).
// Connect() strips it again.
constexpr uint32_t kTrailerMagic = 0x4d43584b;  // "KXCM": the trailer with notice slots
constexpr size_t kTrailerFixed = 8 + 8 + 8 + 8 + 4 + 4;

// ---- Notice slots (see "Notices" in ucx_world.h) --------------------------------------------
// One cache line per (rank, seq modulo kNoticeSeqs), in a MAP_SHARED memfd segment. The
// atomics are lock-free and address-free, so they work across the processes mapping it.
struct alignas(64) NoticeSlot {
  std::atomic<uint64_t> progress{0};  // NoticeKey(seq, step) last posted; 0 = nothing yet
  std::atomic<uint32_t> wake{0};      // futex word: bumped on every post
  std::atomic<uint32_t> sleepers{0};  // waiters inside futex(FUTEX_WAIT) on `wake`
  std::atomic<uint64_t> input{0}, output{0};
  std::atomic<int64_t> elements{0};
};
static_assert(std::atomic<uint64_t>::is_always_lock_free && sizeof(NoticeSlot) == 64);
// How often a waiter asleep on a futex wakes to check its peers' processes and the deadline.
constexpr int kNoticeCheckMs = 10;
// (seq, step) as one number that grows along a rank's program: seq has 31 bits, step 16.
constexpr int kNoticeKeyBits = 47;
uint64_t NoticeKey(uint32_t seq, uint32_t step) {
  return ((static_cast<uint64_t>(seq) << 16) | (step & 0xffffu)) &
         ((uint64_t{1} << kNoticeKeyBits) - 1);
}
// Whether `posted` is `wanted` or later, across the wrap of seq at 2^31.
bool NoticeReached(uint64_t posted, uint64_t wanted) {
  if (posted == 0) return false;
  return ((posted - wanted) & ((uint64_t{1} << kNoticeKeyBits) - 1)) <
         (uint64_t{1} << (kNoticeKeyBits - 1));
}
// A process's segment holds one block per local rank (in local-rank order): the rank's notice
// slots, padded to kNoticeBlockBytes, then its kStagingAreas staging areas. Pages are only
// backed once touched (a staging area costs what the collectives write into it).
constexpr size_t kNoticeBlockBytes = 4096;
static_assert(UcxWorld::kNoticeSeqs * sizeof(NoticeSlot) <= kNoticeBlockBytes);
constexpr size_t kRankBlockBytes =
    kNoticeBlockBytes + UcxWorld::kStagingAreas * UcxWorld::kStagingBytes;
size_t NoticeSegmentBytes(size_t local_ranks) { return local_ranks * kRankBlockBytes; }
NoticeSlot* RankBlock(void* segment, size_t index) {
  return reinterpret_cast<NoticeSlot*>(static_cast<char*>(segment) + index * kRankBlockBytes);
}
// Maps process `pid`'s notice segment (its memfd `fd`) into this process; null on failure.
void* MapNoticeSegment(int64_t pid, int64_t fd, size_t* bytes) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int opened = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (opened < 0) return nullptr;
  struct stat info {};
  void* segment = nullptr;
  if (fstat(opened, &info) == 0 && info.st_size > 0) {
    *bytes = static_cast<size_t>(info.st_size);
    segment = mmap(nullptr, *bytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
    if (segment == MAP_FAILED) segment = nullptr;
  }
  close(opened);  // the mapping keeps the memory
  return segment;
}
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}
// What a peer reads at Connect to prove it can read this process's memory.
constexpr uint64_t kProbeValue = 0x216d6d6f6378616aull;  // "jaxcomm!"
const volatile uint64_t g_probe = kProbeValue;

// Boot id and the PID, network and IPC namespaces: ranks with equal identities share a host
// as far as jaxcomm is concerned. Empty when unknown (then nothing is shared).
std::string HostIdentity() {
  std::string identity;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (!(boot >> boot_id)) return "";
  identity = boot_id;
  for (const char* ns : {"/proc/self/ns/pid", "/proc/self/ns/net", "/proc/self/ns/ipc"}) {
    char link[128];
    const ssize_t length = readlink(ns, link, sizeof(link));
    if (length <= 0) return "";
    identity += "|" + std::string(link, static_cast<size_t>(length));
  }
  return identity;
}

bool SharedMemoryEnabled() {
  const char* env = std::getenv("JAXCOMM_SHARED_MEMORY");
  return env == nullptr || *env == '\0' || std::strcmp(env, "0") != 0;
}

// Copies `bytes` from `address` in process `pid` into `dst`; returns 0 or an errno.
int ReadProcess(int64_t pid, uint64_t address, void* dst, size_t bytes) {
  auto* out = static_cast<char*>(dst);
  while (bytes > 0) {
    iovec local{out, bytes};
    iovec remote{reinterpret_cast<void*>(static_cast<uintptr_t>(address)), bytes};
    const ssize_t got = process_vm_readv(static_cast<pid_t>(pid), &local, 1, &remote, 1, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EFAULT;
    out += got;
    address += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
  return 0;
}

std::string UcsError(ucs_status_t status) {
  return std::string(ucs_status_string(status)) + " (" + std::to_string(status) + ")";
}

void SleepNs(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  nanosleep(&ts, nullptr);
}

}  // namespace

std::string ReadNumberEnv(const char* name, double fallback, bool zero_allowed, double* value) {
  *value = fallback;
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return "";
  // Strict, as jaxcomm/config.py checks it at import: the whole text is one finite number.
  char* end = nullptr;
  const double parsed = std::strtod(env, &end);
  while (end != env && std::isspace(static_cast<unsigned char>(*end))) ++end;
  const bool in_range = zero_allowed ? parsed >= 0 : parsed > 0;
  if (end == env || *end != '\0' || !std::isfinite(parsed) || !in_range) {
    return std::string(name) + "='" + env + "' is not a number " + (zero_allowed ? ">=" : ">") +
           " 0; unset it or set e.g. " + name + "=" + (zero_allowed ? "20" : "120");
  }
  *value = parsed;
  return "";
}

std::chrono::nanoseconds DefaultTimeout() {
  // An invalid value was already refused by UcxWorld::Create (and by jaxcomm.config at import);
  // the default then stands.
  double seconds = kDefaultTimeoutSeconds;
  if (!ReadNumberEnv("JAXCOMM_TIMEOUT_S", kDefaultTimeoutSeconds, false, &seconds).empty()) {
    seconds = kDefaultTimeoutSeconds;
  }
  return std::chrono::nanoseconds(static_cast<int64_t>(seconds * 1e9));
}

Deadline DefaultDeadline() { return Clock::now() + DefaultTimeout(); }

std::string DescribeTag(uint64_t tag) {
  std::string s = TagIsControl(tag) ? "control " : "";
  return s + "seq " + std::to_string(TagSeq(tag)) + " step " + std::to_string(TagStep(tag)) +
         " src " + std::to_string(TagSource(tag));
}

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
  std::vector<std::unique_ptr<LocalRank>> locals;  // parallel to local_ranks_
  // Notices: this process's segment (memfd, mapping) and, by world rank, the first of the
  // rank's kNoticeSeqs slots (null where memory is not shared) and a pidfd of its process
  // (-1 for ranks of this process).
  int notice_fd = -1;
  void* notice_segment = nullptr;
  size_t notice_bytes = 0;
  std::vector<NoticeSlot*> notice_slots;
  std::vector<int> pidfds;
  std::vector<std::pair<void*, size_t>> peer_segments;  // other processes' segments, mapped
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

// ---- Request -----------------------------------------------------------------------------

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    Abandon();
    kind_ = other.kind_;
    self_ = other.self_;
    peer_ = other.peer_;
    tag_ = other.tag_;
    bytes_ = other.bytes_;
    received_ = other.received_;
    done_ = other.done_;
    ucs_status_ = other.ucs_status_;
    ucp_request_ = std::exchange(other.ucp_request_, nullptr);
    worker_ = other.worker_;
    error_ = std::move(other.error_);
    other.done_ = true;
    other.kind_ = Kind::kNone;
  }
  return *this;
}

void Request::Abandon() {
  if (ucp_request_ == nullptr) return;
  // A receive still pending would write into a buffer its owner is about to drop: cancel it.
  // Either way UCX frees the request object once the operation finished.
  if (kind_ == Kind::kRecv && ucp_request_check_status(ucp_request_) == UCS_INPROGRESS) {
    ucp_request_cancel(static_cast<ucp_worker_h>(worker_), ucp_request_);
  }
  ucp_request_free(ucp_request_);
  ucp_request_ = nullptr;
  done_ = true;
}

// ---- UcxWorld ----------------------------------------------------------------------------

int UcxWorld::LocalIndex(int rank) const {
  if (rank < 0 || rank >= world_size_) return -1;
  return local_index_of_rank_[rank];
}

const char* UcxWorld::wait_mode_name() const {
  return impl_ && impl_->mode == WaitMode::kBackoff ? "backoff" : "wakeup";
}

std::unique_ptr<UcxWorld> UcxWorld::Create(int world_size, std::vector<int> local_ranks,
                                           std::string* error) {
  auto fail = [&](std::string message) -> std::unique_ptr<UcxWorld> {
    if (error) *error = "jaxcomm UcxWorld::Create: " + std::move(message);
    return nullptr;
  };
  if (world_size <= 0 || world_size > kMaxWorldSize) {
    return fail("world_size " + std::to_string(world_size) + " not in [1, " +
                std::to_string(kMaxWorldSize) + "] (the tag holds 16 bits of source rank)");
  }
  if (local_ranks.empty()) return fail("no local ranks");
  std::unique_ptr<UcxWorld> world(new UcxWorld());
  world->world_size_ = world_size;
  world->local_index_of_rank_.assign(world_size, -1);
  for (size_t i = 0; i < local_ranks.size(); ++i) {
    int r = local_ranks[i];
    if (r < 0 || r >= world_size) {
      return fail("local rank " + std::to_string(r) + " outside [0, " + std::to_string(world_size) +
                  ")");
    }
    if (world->local_index_of_rank_[r] != -1) {
      return fail("local rank " + std::to_string(r) + " listed twice");
    }
    world->local_index_of_rank_[r] = static_cast<int>(i);
  }
  world->local_ranks_ = std::move(local_ranks);
  world->impl_ = std::make_unique<Impl>();
  Impl& impl = *world->impl_;

  // Wait strategy (see WaitAll): env JAXCOMM_UCX_WAIT=wakeup|backoff, JAXCOMM_UCX_SPIN_US.
  if (const char* env = std::getenv("JAXCOMM_UCX_WAIT"); env != nullptr && *env != '\0') {
    if (std::strcmp(env, "backoff") == 0) {
      impl.mode = WaitMode::kBackoff;
    } else if (std::strcmp(env, "wakeup") != 0) {
      return fail(std::string("JAXCOMM_UCX_WAIT='") + env + "' is not 'wakeup' or 'backoff'");
    }
  }
  double spin_us = 0;
  if (std::string bad = ReadNumberEnv("JAXCOMM_UCX_SPIN_US", 20.0, true, &spin_us); !bad.empty()) {
    return fail(bad);
  }
  impl.spin_ns = static_cast<int64_t>(spin_us * 1000);
  double timeout_s = 0;  // read by DefaultTimeout(); checked here so a bad value fails early
  if (std::string bad =
          ReadNumberEnv("JAXCOMM_TIMEOUT_S", kDefaultTimeoutSeconds, false, &timeout_s);
      !bad.empty()) {
    return fail(bad);
  }

  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) return fail("ucp_config_read: " + UcsError(status));
  // Cross-process endpoints run over tcp (see the top of this file). Its default 8 KiB segments
  // gave ~0.9 GB/s for 64 MiB over loopback here; 256 KiB gave 1.4-2.2 GB/s. A user's own
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
  params.estimated_num_ppn = world->local_ranks_.size();
  params.name = "jaxcomm";
  status = ucp_init(&params, config, &impl.context);
  ucp_config_release(config);
  if (status != UCS_OK) return fail("ucp_init: " + UcsError(status));

  for (int rank : world->local_ranks_) {
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
  // Notice slots (see ucx_world.h). Without them (no memfd) nothing is shared: Connect
  // then leaves every shared-memory path off.
  impl.notice_bytes = NoticeSegmentBytes(world->local_ranks_.size());
  impl.notice_fd = memfd_create("jaxcomm-notices", MFD_CLOEXEC);
  if (impl.notice_fd >= 0 &&
      ftruncate(impl.notice_fd, static_cast<off_t>(impl.notice_bytes)) == 0) {
    void* segment =
        mmap(nullptr, impl.notice_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, impl.notice_fd, 0);
    if (segment != MAP_FAILED) {
      impl.notice_segment = segment;
      for (size_t i = 0; i < world->local_ranks_.size(); ++i) {
        NoticeSlot* slots = RankBlock(segment, i);
        for (uint32_t k = 0; k < kNoticeSeqs; ++k) new (&slots[k]) NoticeSlot();
      }
    }
  }
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
    for (int r = 0; r < world_size_; ++r) {
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
  for (auto& [segment, bytes] : impl.peer_segments) munmap(segment, bytes);
  for (int fd : impl.pidfds) {
    if (fd >= 0) close(fd);
  }
  if (impl.notice_segment != nullptr) munmap(impl.notice_segment, impl.notice_bytes);
  if (impl.notice_fd >= 0) close(impl.notice_fd);
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
  const std::string identity = HostIdentity();
  const int64_t pid = getpid();
  const uint64_t probe = AddressOf(const_cast<const uint64_t*>(&g_probe));
  const int64_t notice_fd = impl_->notice_segment != nullptr ? impl_->notice_fd : -1;
  const int64_t slot_index = index;
  const auto identity_length = static_cast<uint32_t>(identity.size());
  bytes += identity;
  bytes.append(reinterpret_cast<const char*>(&pid), 8);
  bytes.append(reinterpret_cast<const char*>(&probe), 8);
  bytes.append(reinterpret_cast<const char*>(&notice_fd), 8);
  bytes.append(reinterpret_cast<const char*>(&slot_index), 8);
  bytes.append(reinterpret_cast<const char*>(&identity_length), 4);
  bytes.append(reinterpret_cast<const char*>(&kTrailerMagic), 4);
  return bytes;
}

bool UcxWorld::Connect(const std::vector<std::string>& addresses, std::string* error) {
  auto fail = [&](std::string message) {
    if (error) *error = "jaxcomm UcxWorld::Connect: " + std::move(message);
    return false;
  };
  if (connected_) return fail("already connected");
  if (static_cast<int>(addresses.size()) != world_size_) {
    return fail("got " + std::to_string(addresses.size()) + " addresses for a world of " +
                std::to_string(world_size_) + " ranks");
  }
  for (int r = 0; r < world_size_; ++r) {
    if (addresses[r].empty()) return fail("empty address for rank " + std::to_string(r));
  }
  // Split each address into UCX's part and the host trailer (see Address()); decide which
  // ranks' memory this process can read.
  std::vector<std::string> ucx_addresses(addresses);
  shares_memory_.assign(world_size_, false);
  pids_.assign(world_size_, -1);
  const std::string my_identity = HostIdentity();
  const bool enabled = SharedMemoryEnabled() && impl_->notice_segment != nullptr;
  impl_->notice_slots.assign(world_size_, nullptr);
  impl_->pidfds.assign(world_size_, -1);
  // Other processes' notice segments (mapping, bytes), mapped once per process.
  std::map<int64_t, std::pair<void*, size_t>> segment_of_pid;
  const bool cross_process = enabled && !my_identity.empty();
  for (int r = 0; r < world_size_; ++r) {
    std::string& a = ucx_addresses[r];
    uint32_t magic = 0, identity_length = 0;
    if (a.size() >= kTrailerFixed) std::memcpy(&magic, a.data() + a.size() - 4, 4);
    if (magic == kTrailerMagic) {
      std::memcpy(&identity_length, a.data() + a.size() - 8, 4);
      if (a.size() < kTrailerFixed + identity_length) return fail("malformed address trailer");
      const size_t at = a.size() - kTrailerFixed - identity_length;
      const std::string identity = a.substr(at, identity_length);
      int64_t pid = -1, notice_fd = -1, slot_index = -1;
      uint64_t probe = 0;
      std::memcpy(&pid, a.data() + at + identity_length, 8);
      std::memcpy(&probe, a.data() + at + identity_length + 8, 8);
      std::memcpy(&notice_fd, a.data() + at + identity_length + 16, 8);
      std::memcpy(&slot_index, a.data() + at + identity_length + 24, 8);
      a.resize(at);
      if (!enabled) {
        shares_memory_[r] = false;
      } else if (IsLocal(r)) {
        shares_memory_[r] = true;
        impl_->notice_slots[r] = RankBlock(impl_->notice_segment, LocalIndex(r));
      } else if (cross_process && identity == my_identity && pid > 0 && notice_fd >= 0 &&
                 slot_index >= 0) {
        uint64_t seen = 0;
        pids_[r] = pid;
        auto& [segment, segment_bytes] = segment_of_pid[pid];
        if (segment == nullptr) segment = MapNoticeSegment(pid, notice_fd, &segment_bytes);
        const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
        const size_t block_end = (static_cast<size_t>(slot_index) + 1) * kRankBlockBytes;
        shares_memory_[r] = ReadProcess(pid, probe, &seen, sizeof(seen)) == 0 &&
                            seen == kProbeValue && segment != nullptr &&
                            block_end <= segment_bytes && pidfd >= 0;
        if (shares_memory_[r]) {
          impl_->notice_slots[r] = RankBlock(segment, static_cast<size_t>(slot_index));
          impl_->pidfds[r] = pidfd;
        } else if (pidfd >= 0) {
          close(pidfd);
        }
      }
    } else {
      shares_memory_[r] = enabled && IsLocal(r);
    }
  }
  for (auto& [pid, mapped] : segment_of_pid) {
    if (mapped.first != nullptr) impl_->peer_segments.push_back(mapped);
  }
  for (auto& local : impl_->locals) {
    local->links.reset(new PeerLink[world_size_]);
    for (int r = 0; r < world_size_; ++r) {
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

Status UcxWorld::ReadPeer(int peer, uint64_t address, void* dst, size_t bytes,
                          std::string_view context) const {
  if (!SharesMemory(peer)) {
    return Status(StatusCode::kInvalidArgument, std::string(context) + ": rank " +
                                                    std::to_string(peer) +
                                                    " does not share memory with this process");
  }
  if (bytes == 0) return Status::Ok();
  if (IsLocal(peer)) {
    std::memcpy(dst, LocalPointer(peer, address), bytes);
    return Status::Ok();
  }
  const int error = ReadProcess(pids_[peer], address, dst, bytes);
  if (error == 0) return Status::Ok();
  if (error == ESRCH) {
    return Status(StatusCode::kPeerFailed, std::string(context) + ": peer rank " +
                                               std::to_string(peer) + " failed (process " +
                                               std::to_string(pids_[peer]) + " is gone)");
  }
  return Status(StatusCode::kInternal, std::string(context) + ": reading " + std::to_string(bytes) +
                                           " bytes of peer rank " + std::to_string(peer) +
                                           "'s memory failed: " + std::strerror(error));
}

void* UcxWorld::StagingArea(int rank, uint32_t seq) const {
  if (rank < 0 || rank >= world_size_ || impl_->notice_slots.empty() ||
      impl_->notice_slots[rank] == nullptr) {
    return nullptr;
  }
  return reinterpret_cast<char*>(impl_->notice_slots[rank]) + kNoticeBlockBytes +
         (seq % kStagingAreas) * kStagingBytes;
}

void UcxWorld::PostNotice(int self, uint32_t seq, uint32_t step, const Notice* notice) {
  NoticeSlot* slots = IsLocal(self) ? impl_->notice_slots[self] : nullptr;
  if (slots == nullptr) return;  // WaitNotices of the peers fails on their side
  NoticeSlot& slot = slots[seq % kNoticeSeqs];
  if (notice != nullptr) {
    // Read by peers only after they saw `progress` (seq_cst below orders these before it).
    slot.input.store(notice->input, std::memory_order_relaxed);
    slot.output.store(notice->output, std::memory_order_relaxed);
    slot.elements.store(notice->elements, std::memory_order_relaxed);
  }
  slot.progress.store(NoticeKey(seq, step));
  // A waiter registers in `sleepers` before its last look at `progress` and sleeps only while
  // `wake` is unchanged, so either it sees this post or this sees it and wakes it.
  slot.wake.fetch_add(1);
  if (slot.sleepers.load() > 0) FutexWakeAll(&slot.wake);
}

Status UcxWorld::WaitNotices(int self, const int* peers, size_t count, uint32_t seq, uint32_t step,
                             Notice* notices, Deadline deadline, std::string_view context) {
  const uint64_t wanted = NoticeKey(seq, step);
  auto where = [&] {
    return " while rank " + std::to_string(self) + " waited for seq " + std::to_string(seq) +
           " step " + std::to_string(step);
  };
  for (size_t i = 0; i < count; ++i) {
    if (!IsLocal(self) || peers[i] < 0 || peers[i] >= world_size_ ||
        impl_->notice_slots[peers[i]] == nullptr) {
      return Status(StatusCode::kInvalidArgument,
                    std::string(context) + ": rank " + std::to_string(peers[i]) +
                        " has no notice slot shared with rank " + std::to_string(self));
    }
  }
  auto slot_of = [&](size_t i) -> NoticeSlot& {
    return impl_->notice_slots[peers[i]][seq % kNoticeSeqs];
  };
  size_t next = 0;  // peers before `next` have reached the step
  const Deadline spin_until = Clock::now() + std::chrono::nanoseconds(impl_->spin_ns);
  for (;;) {
    while (next < count && NoticeReached(slot_of(next).progress.load(), wanted)) ++next;
    if (next == count) break;
    const Deadline now = Clock::now();
    if (now < spin_until) {
      sched_yield();
      continue;
    }
    // Dead processes first: their slots will never move.
    for (size_t i = next; i < count; ++i) {
      const int pidfd = impl_->pidfds[peers[i]];
      if (pidfd < 0) continue;
      pollfd exited{pidfd, POLLIN, 0};
      if (poll(&exited, 1, 0) > 0) {
        return Status(StatusCode::kPeerFailed,
                      std::string(context) + ": peer rank " + std::to_string(peers[i]) +
                          " failed (its process " + std::to_string(pids_[peers[i]]) + " exited)" +
                          where());
      }
    }
    if (now >= deadline) {
      std::string late;
      for (size_t i = next; i < count; ++i) {
        if (!NoticeReached(slot_of(i).progress.load(), wanted)) {
          late += (late.empty() ? "" : ", ") + std::to_string(peers[i]);
        }
      }
      return Status(StatusCode::kDeadlineExceeded, std::string(context) + ": deadline exceeded" +
                                                       where() + "; waiting on peer rank(s) " +
                                                       late +
                                                       " (default timeout: env JAXCOMM_TIMEOUT_S)");
    }
    NoticeSlot& slot = slot_of(next);
    const uint32_t seen = slot.wake.load();
    slot.sleepers.fetch_add(1);
    if (!NoticeReached(slot.progress.load(), wanted)) {
      const int64_t remaining_ns =
          std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now).count() + 1;
      FutexWait(&slot.wake, seen, std::min<int64_t>(remaining_ns, kNoticeCheckMs * 1000000));
    }
    slot.sleepers.fetch_sub(1);
  }
  if (notices != nullptr) {
    for (size_t i = 0; i < count; ++i) {
      const NoticeSlot& slot = slot_of(i);
      notices[i] = {slot.input.load(std::memory_order_relaxed),
                    slot.output.load(std::memory_order_relaxed),
                    slot.elements.load(std::memory_order_relaxed)};
    }
  }
  return Status::Ok();
}

int UcxWorld::StartRequest(Request& r, int self, int peer, uint64_t tag, size_t bytes) const {
  r.self_ = self;
  r.peer_ = peer;
  r.tag_ = tag;
  r.bytes_ = bytes;
  r.done_ = true;
  const int index = LocalIndex(self);
  if (index < 0 || peer < 0 || peer >= world_size_ || !connected_) {
    r.ucs_status_ = UCS_ERR_INVALID_PARAM;
    r.error_ = !connected_ ? "world not connected"
                           : "invalid self " + std::to_string(self) + " (local?) or peer " +
                                 std::to_string(peer);
    return -1;
  }
  // A send is tagged with its own rank, a receive with the peer it expects.
  const int source = r.is_send() ? self : peer;
  if (TagSource(tag) != static_cast<uint32_t>(source % kMaxWorldSize)) {
    r.ucs_status_ = UCS_ERR_INVALID_PARAM;
    r.error_ = std::string(r.is_send() ? "send tag source " : "receive tag source ") +
               std::to_string(TagSource(tag)) + (r.is_send() ? " is not self" : " is not the peer");
    return -1;
  }
  return index;
}

Request UcxWorld::Isend(int self, int peer, uint64_t tag, const void* data, size_t bytes) {
  Request r;
  r.kind_ = Request::Kind::kSend;
  const int index = StartRequest(r, self, peer, tag, bytes);
  if (index < 0) return r;
  LocalRank& l = *impl_->locals[index];
  PeerLink& link = l.links[peer];
  r.worker_ = l.worker;
  if (int f = link.failure.load(); f != UCS_OK || link.ep == nullptr) {
    r.ucs_status_ = f != UCS_OK ? f : UCS_ERR_CANCELED;
    r.error_ = "link to peer already failed: " + UcsError(static_cast<ucs_status_t>(r.ucs_status_));
    return r;
  }
  ucp_request_param_t p{};
  void* req = ucp_tag_send_nbx(link.ep, data, bytes, tag, &p);
  if (req == nullptr) {
    r.ucs_status_ = UCS_OK;
    l.bytes_sent.fetch_add(bytes, std::memory_order_relaxed);
    l.messages_sent.fetch_add(1, std::memory_order_relaxed);
  } else if (UCS_PTR_IS_ERR(req)) {
    r.ucs_status_ = UCS_PTR_STATUS(req);
    r.error_ = "ucp_tag_send_nbx: " + UcsError(UCS_PTR_STATUS(req));
  } else {
    r.ucp_request_ = req;
    r.done_ = false;
  }
  return r;
}

Request UcxWorld::Irecv(int self, int peer, uint64_t tag, void* data, size_t capacity) {
  Request r;
  r.kind_ = Request::Kind::kRecv;
  const int index = StartRequest(r, self, peer, tag, capacity);
  if (index < 0) return r;
  LocalRank& l = *impl_->locals[index];
  r.worker_ = l.worker;
  ucp_tag_recv_info_t info{};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_RECV_INFO;
  p.recv_info.tag_info = &info;
  // Full 64-bit mask: seq, step and source must all match.
  void* req = ucp_tag_recv_nbx(l.worker, data, capacity, tag, ~uint64_t{0}, &p);
  if (req == nullptr) {
    r.ucs_status_ = UCS_OK;
    r.received_ = info.length;
    l.bytes_received.fetch_add(info.length, std::memory_order_relaxed);
    l.messages_received.fetch_add(1, std::memory_order_relaxed);
  } else if (UCS_PTR_IS_ERR(req)) {
    r.ucs_status_ = UCS_PTR_STATUS(req);
    r.error_ = "ucp_tag_recv_nbx: " + UcsError(UCS_PTR_STATUS(req));
  } else {
    r.ucp_request_ = req;
    r.done_ = false;
  }
  return r;
}

Status UcxWorld::WaitAll(int self, Request* requests, size_t count, Deadline deadline,
                         std::string_view context) {
  int index = LocalIndex(self);
  auto describe = [&](const Request& r) {
    return std::string(r.is_send() ? "send to" : "receive from") + " rank " +
           std::to_string(r.peer_) + " (" + DescribeTag(r.tag_) + ") on rank " +
           std::to_string(self);
  };
  if (index < 0) {
    return Status(StatusCode::kInvalidArgument,
                  std::string(context) + ": rank " + std::to_string(self) + " is not local");
  }
  LocalRank& l = *impl_->locals[index];
  const Impl& impl = *impl_;

  // Completes request `r` if UCX finished it; returns whether it is done.
  auto poll_request = [&](Request& r) {
    if (r.done_) return true;
    ucs_status_t st = ucp_request_check_status(r.ucp_request_);
    if (st == UCS_INPROGRESS) return false;
    if (r.is_recv() && st == UCS_OK) {
      ucp_tag_recv_info_t info{};
      ucp_tag_recv_request_test(r.ucp_request_, &info);
      r.received_ = info.length;
      l.bytes_received.fetch_add(info.length, std::memory_order_relaxed);
      l.messages_received.fetch_add(1, std::memory_order_relaxed);
    } else if (r.is_send() && st == UCS_OK) {
      l.bytes_sent.fetch_add(r.bytes_, std::memory_order_relaxed);
      l.messages_sent.fetch_add(1, std::memory_order_relaxed);
    }
    ucp_request_free(r.ucp_request_);
    r.ucp_request_ = nullptr;
    r.ucs_status_ = st;
    r.done_ = true;
    return true;
  };

  Status error;
  Deadline idle_since = Clock::now();
  int64_t backoff_ns = 1000;
  for (;;) {
    size_t pending = 0;
    for (size_t i = 0; i < count && error.ok(); ++i) {
      Request& r = requests[i];
      if (!poll_request(r)) {
        ++pending;
        // A receive is not bound to an endpoint, so UCX cannot fail it when the sender dies:
        // check the link's error flag ourselves (sends to that peer fail inside UCX).
        int f = l.links ? l.links[r.peer_].failure.load() : UCS_OK;
        if (f != UCS_OK) {
          error =
              Status(StatusCode::kPeerFailed,
                     std::string(context) + ": peer rank " + std::to_string(r.peer_) + " failed (" +
                         UcsError(static_cast<ucs_status_t>(f)) + ") during " + describe(r));
        }
      } else if (r.ucs_status_ != UCS_OK) {
        auto st = static_cast<ucs_status_t>(r.ucs_status_);
        bool peer_down = st == UCS_ERR_CONNECTION_RESET || st == UCS_ERR_ENDPOINT_TIMEOUT ||
                         st == UCS_ERR_UNREACHABLE || st == UCS_ERR_CANCELED;
        std::string what = !r.error_.empty() ? r.error_ : UcsError(st);
        if (st == UCS_ERR_MESSAGE_TRUNCATED) {
          what =
              "message longer than the receive capacity of " + std::to_string(r.bytes_) + " bytes";
        }
        StatusCode code = peer_down                     ? StatusCode::kPeerFailed
                          : st == UCS_ERR_INVALID_PARAM ? StatusCode::kInvalidArgument
                                                        : StatusCode::kInternal;
        error = Status(code, std::string(context) + ": " + describe(r) + " failed: " + what +
                                 (peer_down ? " (peer rank " + std::to_string(r.peer_) + " failed)"
                                            : std::string()));
      }
    }
    if (error.ok() && pending > 0 && l.links) {
      // A dead peer anywhere in the world dooms this program too, even while this rank waits
      // on a live one (a ring rank only hears from its left neighbour, who may be waiting on
      // the dead one): fail now and name the dead peer, not the neighbour that went quiet.
      for (int peer = 0; peer < world_size_ && error.ok(); ++peer) {
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
        if (requests[i].done_) continue;
        if (which.empty()) which = describe(requests[i]);
        peers.insert(requests[i].peer_);
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
    Request& r = requests[i];
    if (!r.done_ && r.ucp_request_ != nullptr) ucp_request_cancel(l.worker, r.ucp_request_);
  }
  auto drain = [&](Deadline until) {
    bool all = false;
    while (!all) {
      all = true;
      for (size_t i = 0; i < count; ++i) all = poll_request(requests[i]) && all;
      if (all || Clock::now() >= until) break;
      if (ucp_worker_progress(l.worker) == 0) SleepNs(20000);
    }
    return all;
  };
  if (!drain(Clock::now() + kCancelGrace)) {
    // Sends UCX could not cancel (e.g. rendezvous waiting for a receiver that never comes):
    // force-close those endpoints, which completes their requests with an error.
    for (size_t i = 0; i < count; ++i) {
      Request& r = requests[i];
      if (r.done_ || !r.is_send()) continue;
      PeerLink& link = l.links[r.peer_];
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
    if (!requests[i].done_) requests[i].Abandon();  // last resort: UCX frees it later
  }
  return error;
}

Status UcxWorld::SendRecv(int self, int send_peer, uint64_t send_tag, const void* send_data,
                          size_t send_bytes, int recv_peer, uint64_t recv_tag, void* recv_data,
                          size_t recv_capacity, size_t* received, Deadline deadline,
                          std::string_view context) {
  // Post the receive first so an eager message from recv_peer lands directly in place.
  Request requests[2];
  requests[0] = Irecv(self, recv_peer, recv_tag, recv_data, recv_capacity);
  requests[1] = Isend(self, send_peer, send_tag, send_data, send_bytes);
  Status status = WaitAll(self, requests, 2, deadline, context);
  if (received != nullptr) *received = status.ok() ? requests[0].received_bytes() : 0;
  return status;
}

Status UcxWorld::Send(int self, int peer, uint64_t tag, const void* data, size_t bytes,
                      Deadline deadline, std::string_view context) {
  Request request = Isend(self, peer, tag, data, bytes);
  return WaitAll(self, &request, 1, deadline, context);
}

Status UcxWorld::Recv(int self, int peer, uint64_t tag, void* data, size_t capacity,
                      size_t* received, Deadline deadline, std::string_view context) {
  Request request = Irecv(self, peer, tag, data, capacity);
  Status status = WaitAll(self, &request, 1, deadline, context);
  if (received != nullptr) *received = status.ok() ? request.received_bytes() : 0;
  return status;
}

}  // namespace jaxcomm::transport
