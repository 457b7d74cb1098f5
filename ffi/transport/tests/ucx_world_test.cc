// Tests of the UCX transport: in-process ranks on threads, two processes (fork) with addresses
// swapped over a socketpair, deadlines, a killed peer, counters.
#include "ffi/transport/ucx_world.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ffi/transport/tests/scoped_env.h"

namespace jaxcomm::transport {
namespace {

using namespace std::chrono_literals;

constexpr size_t kMiB = size_t{1} << 20;

Deadline In(std::chrono::milliseconds ms) { return Clock::now() + ms; }

// A world whose ranks all live in this process.
std::unique_ptr<UcxWorld> LocalWorld(int size) {
  std::vector<int> ranks(size);
  for (int i = 0; i < size; ++i) ranks[i] = i;
  std::string error;
  auto world = UcxWorld::Create(size, ranks, &error);
  EXPECT_NE(world, nullptr) << error;
  if (!world) return nullptr;
  std::vector<std::string> addresses;
  for (int i = 0; i < size; ++i) addresses.push_back(world->Address(i));
  EXPECT_TRUE(world->Connect(addresses, &error)) << error;
  return world;
}

uint8_t Pattern(int rank, size_t i) { return static_cast<uint8_t>(rank * 131 + i * 7 + (i >> 12)); }

std::vector<uint8_t> Filled(int rank, size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Pattern(rank, i);
  return v;
}

bool Matches(const std::vector<uint8_t>& v, int rank, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (v[i] != Pattern(rank, i)) return false;
  }
  return true;
}

TEST(UcxTag, LayoutRoundTrips) {
  uint64_t tag = MakeTag(123456, 65535, 4242);
  EXPECT_EQ(TagSeq(tag), 123456u);
  EXPECT_EQ(TagStep(tag), 65535u);
  EXPECT_EQ(TagSource(tag), 4242u);
  EXPECT_FALSE(TagIsControl(tag));
  EXPECT_TRUE(TagIsControl(MakeControlTag(1, 2, 3)));
  EXPECT_NE(MakeTag(1, 2, 3), MakeControlTag(1, 2, 3));
  EXPECT_NE(MakeTag(1, 2, 3), MakeTag(2, 2, 3));
  EXPECT_NE(MakeTag(1, 2, 3), MakeTag(1, 3, 3));
  EXPECT_EQ(TagSeq(MakeTag(0xffffffffu, 0, 0)), (1u << 31) - 1);  // seq wraps in 31 bits
  EXPECT_EQ(DescribeTag(MakeTag(5, 2, 1)), "seq 5 step 2 src 1");
}

TEST(UcxTimeout, DefaultFromEnv) {
  {
    ScopedEnv timeout("JAXCOMM_TIMEOUT_S", "2.5");
    EXPECT_EQ(DefaultTimeout(), std::chrono::milliseconds(2500));
  }
  EXPECT_EQ(DefaultTimeout(), std::chrono::seconds(120));
}

// The C++ parse is as strict as jaxcomm/config.py: a bad value fails Create, naming the variable.
TEST(UcxWorld, CreateRejectsBadSettings) {
  const std::pair<const char*, const char*> bad[] = {{"JAXCOMM_UCX_SPIN_US", "fast"},
                                                     {"JAXCOMM_UCX_SPIN_US", "-1"},
                                                     {"JAXCOMM_TIMEOUT_S", "0"},
                                                     {"JAXCOMM_TIMEOUT_S", "5s"}};
  for (const auto& [name, value] : bad) {
    ScopedEnv setting(name, value);
    std::string error;
    EXPECT_EQ(UcxWorld::Create(1, {0}, &error), nullptr) << name << "=" << value;
    EXPECT_NE(error.find(std::string(name) + "='" + value + "'"), std::string::npos) << error;
  }
  EXPECT_EQ(DefaultTimeout(), std::chrono::seconds(120));
}

TEST(UcxWorld, CreateRejectsBadRanks) {
  std::string error;
  EXPECT_EQ(UcxWorld::Create(2, {0, 2}, &error), nullptr);
  EXPECT_NE(error.find("local rank 2"), std::string::npos) << error;
  EXPECT_EQ(UcxWorld::Create(2, {1, 1}, &error), nullptr);
  EXPECT_NE(error.find("twice"), std::string::npos) << error;
}

// 4 ranks on 4 threads, each sending to rank+1 and receiving from rank-1, for each size.
TEST(UcxWorld, RingOnFourThreads) {
  constexpr int kRanks = 4;
  auto world = LocalWorld(kRanks);
  ASSERT_NE(world, nullptr);
  const std::vector<size_t> sizes = {0, 1, 4, kMiB, 64 * kMiB};
  std::vector<std::string> failures(kRanks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      int next = (rank + 1) % kRanks, prev = (rank + kRanks - 1) % kRanks;
      for (size_t step = 0; step < sizes.size(); ++step) {
        size_t n = sizes[step];
        std::vector<uint8_t> out = Filled(rank, n), in(n + 16, 0);
        size_t received = 12345;
        Status s = world->SendRecv(rank, next, MakeTag(7, step, rank), out.data(), n, prev,
                                   MakeTag(7, step, prev), in.data(), in.size(), &received, In(60s),
                                   "ring test");
        if (!s.ok()) {
          failures[rank] = s.message();
          return;
        }
        if (received != n || !Matches(in, prev, n)) {
          failures[rank] = "bad data at size " + std::to_string(n);
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < kRanks; ++rank) EXPECT_EQ(failures[rank], "") << "rank " << rank;
  size_t total = 0;
  for (size_t n : sizes) total += n;
  for (int rank = 0; rank < kRanks; ++rank) {
    Counters c = world->GetCounters(rank);
    EXPECT_EQ(c.bytes_sent, total);
    EXPECT_EQ(c.bytes_received, total);
    EXPECT_EQ(c.messages_sent, sizes.size());
    EXPECT_EQ(c.messages_received, sizes.size());
  }
}

TEST(UcxWorld, VariableLengthAndTruncation) {
  auto world = LocalWorld(2);
  ASSERT_NE(world, nullptr);
  std::vector<uint8_t> out = Filled(0, 100), in(1000, 0);
  std::thread sender([&] {
    EXPECT_TRUE(world->Send(0, 1, MakeTag(1, 0, 0), out.data(), 10, In(20s), "t").ok());
    EXPECT_TRUE(world->Send(0, 1, MakeTag(1, 1, 0), out.data(), 100, In(20s), "t").ok());
  });
  size_t received = 0;
  Status s = world->Recv(1, 0, MakeTag(1, 0, 0), in.data(), in.size(), &received, In(20s), "t");
  EXPECT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(received, 10u);
  EXPECT_TRUE(Matches(in, 0, 10));
  s = world->Recv(1, 0, MakeTag(1, 1, 0), in.data(), 50, &received, In(20s), "truncate test");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("truncate test"), std::string::npos) << s.message();
  sender.join();
}

// Messages of different steps posted in reverse order still land by tag.
TEST(UcxWorld, MatchesFullTag) {
  auto world = LocalWorld(2);
  ASSERT_NE(world, nullptr);
  uint32_t a = 1, b = 2, x = 0, y = 0;
  std::vector<Request> sends;
  sends.push_back(world->PostSend(0, 1, MakeTag(9, 1, 0), &a, 4));
  sends.push_back(world->PostSend(0, 1, MakeTag(10, 1, 0), &b, 4));
  std::vector<Request> recvs;
  recvs.push_back(world->PostRecv(1, 0, MakeTag(10, 1, 0), &y, 4));
  recvs.push_back(world->PostRecv(1, 0, MakeTag(9, 1, 0), &x, 4));
  std::thread t([&] { EXPECT_TRUE(world->Wait(0, sends, In(20s), "s").ok()); });
  EXPECT_TRUE(world->Wait(1, recvs, In(20s), "r").ok());
  t.join();
  EXPECT_EQ(x, 1u);
  EXPECT_EQ(y, 2u);
  // A tag whose source is not the sender is refused.
  Request bad = world->PostSend(0, 1, MakeTag(1, 1, 1), &a, 4);
  Status s = world->Wait(0, &bad, 1, In(1s), "bad tag");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

TEST(UcxWorld, DeadlineNamesContextTagAndPeer) {
  auto world = LocalWorld(2);
  ASSERT_NE(world, nullptr);
  uint32_t x = 0;
  auto start = Clock::now();
  Status s = world->Recv(0, 1, MakeTag(7, 3, 1), &x, 4, nullptr, In(300ms), "jaxcomm.test_op");
  auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("jaxcomm.test_op"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("seq 7 step 3"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("peer rank(s) 1"), std::string::npos) << s.message();
  EXPECT_GE(waited, 300ms);
  EXPECT_LT(waited, 1500ms);
  // A rendezvous send nobody receives is cancelled without hanging.
  std::vector<uint8_t> big(8 * kMiB, 1);
  s = world->Send(0, 1, MakeTag(8, 0, 0), big.data(), big.size(), In(200ms), "big send");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.message();
}

// ---- Two processes -----------------------------------------------------------------------

// Calls io(fd, p, left) (read or write) until all n bytes have moved; false on error or EOF.
template <typename Byte, typename Io>
bool MoveAll(Io io, int fd, Byte* p, size_t n) {
  while (n > 0) {
    const ssize_t moved = io(fd, p, n);
    if (moved <= 0) return false;
    p += moved;
    n -= static_cast<size_t>(moved);
  }
  return true;
}

bool WriteAll(int fd, const void* data, size_t n) {
  return MoveAll(write, fd, static_cast<const char*>(data), n);
}

bool ReadAll(int fd, void* data, size_t n) {
  return MoveAll(read, fd, static_cast<char*>(data), n);
}

// Swaps addresses with the other process over `fd`; returns the addresses by rank.
std::vector<std::string> SwapAddresses(int fd, int my_rank, const std::string& mine) {
  uint64_t n = mine.size();
  std::vector<std::string> all(2);
  all[my_rank] = mine;
  if (!WriteAll(fd, &n, sizeof n) || !WriteAll(fd, mine.data(), mine.size())) return {};
  if (!ReadAll(fd, &n, sizeof n)) return {};
  all[1 - my_rank].resize(n);
  if (!ReadAll(fd, all[1 - my_rank].data(), n)) return {};
  return all;
}

// Creates rank `rank` of a 2-process world and connects it through `fd`.
std::unique_ptr<UcxWorld> ProcessWorld(int fd, int rank, std::string* error) {
  auto world = UcxWorld::Create(2, {rank}, error);
  if (!world) return nullptr;
  auto all = SwapAddresses(fd, rank, world->Address(rank));
  if (all.empty()) {
    *error = "address swap failed";
    return nullptr;
  }
  if (!world->Connect(all, error)) return nullptr;
  return world;
}

// Runs `body` in a forked child and returns its pid; the child exits with body's result and
// never returns into GoogleTest.
pid_t Fork(const std::function<int()>& body) {
  pid_t pid = fork();
  if (pid == 0) {
    int code = body();
    _exit(code);
  }
  return pid;
}

int ExitCode(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A world of two processes: a forked child joins as rank 1 and runs `child_body` on its world
// (exit code 10 if it cannot join); the caller is rank 0 (`world` null, `error` saying why, if
// it cannot join). The socketpair carries the address swap.
struct TwoProcessWorld {
  pid_t child = -1;
  int fd = -1;
  std::unique_ptr<UcxWorld> world;
  std::string error;
  ~TwoProcessWorld() {
    world.reset();
    if (fd >= 0) close(fd);
  }
};

std::unique_ptr<TwoProcessWorld> StartTwoProcessWorld(
    const std::function<int(UcxWorld&)>& child_body) {
  auto out = std::make_unique<TwoProcessWorld>();
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) {
    out->error = "socketpair failed";
    return out;
  }
  out->child = Fork([&] {
    close(fds[0]);
    std::string error;
    auto world = ProcessWorld(fds[1], 1, &error);
    return world ? child_body(*world) : 10;
  });
  close(fds[1]);
  out->fd = fds[0];
  out->world = ProcessWorld(fds[0], 0, &out->error);
  return out;
}

// Both processes exchange every size with each other (a 2-rank ring).
int Exchange(UcxWorld& world, int rank, const std::vector<size_t>& sizes, std::string* error) {
  int peer = 1 - rank;
  for (size_t step = 0; step < sizes.size(); ++step) {
    size_t n = sizes[step];
    std::vector<uint8_t> out = Filled(rank, n), in(n + 8);
    size_t received = 0;
    Status s = world.SendRecv(rank, peer, MakeTag(3, step, rank), out.data(), n, peer,
                              MakeTag(3, step, peer), in.data(), in.size(), &received, In(60s),
                              "two-process test");
    if (!s.ok()) {
      *error = s.message();
      return 1;
    }
    if (received != n || !Matches(in, peer, n)) {
      *error = "bad data at size " + std::to_string(n);
      return 2;
    }
  }
  return 0;
}

TEST(UcxWorld, TwoProcesses) {
  const std::vector<size_t> sizes = {0, 1, 4, kMiB, 64 * kMiB};
  auto pair = StartTwoProcessWorld([&](UcxWorld& world) {
    std::string error;
    int rc = Exchange(world, 1, sizes, &error);
    if (rc != 0) fprintf(stderr, "child: %s\n", error.c_str());
    return rc;
  });
  ASSERT_NE(pair->world, nullptr) << pair->error;
  auto& world = pair->world;
  std::string error;
  EXPECT_EQ(Exchange(*world, 0, sizes, &error), 0) << error;
  EXPECT_EQ(ExitCode(pair->child), 0);
  Counters c = world->GetCounters(0);
  EXPECT_EQ(c.messages_sent, sizes.size());
  EXPECT_EQ(c.bytes_received, 64 * kMiB + kMiB + 5);
}

TEST(UcxWorld, KilledPeerFailsWaitPromptly) {
  auto pair = StartTwoProcessWorld([](UcxWorld& world) {
    std::string error;
    if (Exchange(world, 1, {4, kMiB}, &error) != 0) return 10;
    // Mid-exchange: wait for a message the parent never sends, until SIGKILL arrives.
    std::vector<uint8_t> in(64 * kMiB);
    world.Recv(1, 0, MakeTag(99, 0, 0), in.data(), in.size(), nullptr, In(60s), "child");
    return 11;
  });
  ASSERT_NE(pair->world, nullptr) << pair->error;
  auto& world = pair->world;
  const pid_t child = pair->child;
  std::string error;
  ASSERT_EQ(Exchange(*world, 0, {4, kMiB}, &error), 0) << error;
  std::thread killer([&] {
    std::this_thread::sleep_for(300ms);
    kill(child, SIGKILL);
  });
  // A 64 MiB send the child never matches (rendezvous stays pending) plus a receive.
  std::vector<uint8_t> out(64 * kMiB, 3), in(64);
  auto start = Clock::now();
  Status s = world->SendRecv(0, 1, MakeTag(5, 0, 0), out.data(), out.size(), 1, MakeTag(5, 1, 1),
                             in.data(), in.size(), nullptr, In(60s), "killed-peer test");
  auto waited = Clock::now() - start;
  killer.join();
  EXPECT_EQ(s.code(), StatusCode::kPeerFailed) << s.message();
  EXPECT_NE(s.message().find("peer rank 1"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("killed-peer test"), std::string::npos) << s.message();
  EXPECT_LT(waited, 5s);
  EXPECT_EQ(ExitCode(child), 128 + SIGKILL);
  // Later operations towards the dead peer fail at once, and teardown does not hang.
  s = world->Send(0, 1, MakeTag(6, 0, 0), out.data(), 4, In(10s), "after death");
  EXPECT_EQ(s.code(), StatusCode::kPeerFailed) << s.message();
  auto teardown = Clock::now();
  world.reset();
  EXPECT_LT(Clock::now() - teardown, 5s);
}

TEST(UcxNotices, PostAndWaitOnThreads) {
  auto world = LocalWorld(3);
  ASSERT_NE(world, nullptr);
  // Three ranks, two steps of collective 5: each says where its buffers are, then "done".
  std::vector<std::thread> threads;
  std::vector<std::string> errors(3);
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      const UcxWorld::Notice mine{uint64_t(100 + r), uint64_t(200 + r), 42};
      world->PostNotice(r, 5, 0, &mine);
      std::vector<int> peers;
      for (int q = 0; q < 3; ++q) {
        if (q != r) peers.push_back(q);
      }
      std::vector<UcxWorld::Notice> got(2);
      Status s = world->WaitNotices(r, peers.data(), 2, 5, 0, got.data(), In(10s), "notices");
      if (!s.ok()) errors[r] = s.message();
      for (size_t i = 0; i < 2; ++i) {
        if (got[i].input != uint64_t(100 + peers[i]) || got[i].output != uint64_t(200 + peers[i]) ||
            got[i].elements != 42) {
          errors[r] = "rank " + std::to_string(r) + " read a wrong notice of rank " +
                      std::to_string(peers[i]);
        }
      }
      world->PostNotice(r, 5, 1, nullptr);
      s = world->WaitNotices(r, peers.data(), 2, 5, 1, nullptr, In(10s), "notices");
      if (!s.ok()) errors[r] = s.message();
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  // A later step of collective 5 that rank 2 never posts: the deadline names it and the step.
  const int peers[] = {1, 2};
  world->PostNotice(1, 5, 2, nullptr);
  Status s = world->WaitNotices(0, peers, 2, 5, 2, nullptr, In(200ms), "jaxcomm.test_op");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("jaxcomm.test_op"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("seq 5 step 2"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("peer rank(s) 2 "), std::string::npos) << s.message();
  // Collective 13 shares collective 5's slot (seq modulo kNoticeSeqs): a post for 13 counts as
  // having passed every step of 5, and 5's posts do not count for 13.
  world->PostNotice(2, 13, 0, nullptr);
  EXPECT_TRUE(world->WaitNotices(0, peers, 2, 5, 2, nullptr, In(10s), "wrap").ok());
  s = world->WaitNotices(0, peers, 1, 13, 0, nullptr, In(50ms), "wrap");
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << s.message();
}

TEST(UcxNotices, StagingAndAKilledPeerProcess) {
  auto pair = StartTwoProcessWorld([](UcxWorld& world) {
    // Fill the staging area of collective 3, then say so; then wait to be killed.
    auto* staged = static_cast<uint32_t*>(world.StagingArea(1, 3));
    if (staged == nullptr) return 11;
    for (uint32_t i = 0; i < 1024; ++i) staged[i] = 7 * i + 1;
    const UcxWorld::Notice mine{0, 0, 1024};
    world.PostNotice(1, 3, 0, &mine);
    pause();
    return 12;
  });
  ASSERT_NE(pair->world, nullptr) << pair->error;
  auto& world = pair->world;
  const pid_t child = pair->child;
  ASSERT_TRUE(world->SharesMemory(1)) << "a forked child on this host shares memory";
  const int peer[] = {1};
  UcxWorld::Notice got;
  Status s = world->WaitNotices(0, peer, 1, 3, 0, &got, In(30s), "staging test");
  ASSERT_TRUE(s.ok()) << s.message();
  EXPECT_EQ(got.elements, 1024);
  const auto* staged = static_cast<const uint32_t*>(world->StagingArea(1, 3));
  ASSERT_NE(staged, nullptr);
  for (uint32_t i = 0; i < 1024; ++i) ASSERT_EQ(staged[i], 7 * i + 1) << i;
  // The child never posts step 1; once it is killed the wait fails naming it, long before the
  // deadline.
  std::thread killer([&] {
    std::this_thread::sleep_for(200ms);
    kill(child, SIGKILL);
  });
  s = world->WaitNotices(0, peer, 1, 3, 1, nullptr, In(60s), "killed-peer notices");
  killer.join();
  EXPECT_EQ(s.code(), StatusCode::kPeerFailed) << s.message();
  EXPECT_NE(s.message().find("peer rank 1 failed"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("exited"), std::string::npos) << s.message();
  EXPECT_EQ(ExitCode(child), 128 + SIGKILL);
}

}  // namespace
}  // namespace jaxcomm::transport
