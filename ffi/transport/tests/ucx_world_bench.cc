// Ping-pong latency / bandwidth of the UCX transport, 2 ranks as 2 threads of one process or as
// 2 processes (fork), plus an in-process "direct" baseline (mutex/condvar mailbox + memcpy) to
// judge whether a non-UCX path for same-process ranks is worth it. Not built by CMake (not a
// *_test.cc); build by hand:
//   U=$(python -c "import libucx,os;print(os.path.dirname(libucx.__file__))")
//   g++ -O2 -std=c++17 -I. -I$U/include ffi/transport/tests/ucx_world_bench.cc \
//       ffi/transport/ucx_world.cc -L$U/lib -lucp -lucs -lpthread -o /tmp/ucx_bench
//   LD_LIBRARY_PATH=$U/lib JAXCOMM_UCX_WAIT=wakeup JAXCOMM_UCX_SPIN_US=20 /tmp/ucx_bench
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ffi/transport/ucx_world.h"

using namespace jaxcomm::transport;

namespace {

constexpr size_t kSmall = 4;
constexpr size_t kLarge = size_t{64} << 20;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Runs `iters` round trips of `bytes` between rank 0 and rank 1; returns seconds per one-way
// message as measured by rank 0 (rank 1's return value is meaningless).
double PingPong(UcxWorld& w, int rank, size_t bytes, int iters) {
  std::vector<char> out(bytes, 1), in(bytes);
  int peer = 1 - rank;
  auto start = Clock::now();
  for (int i = 0; i < iters; ++i) {
    Status s;
    if (rank == 0) {
      std::vector<Request> r;
      r.push_back(w.Irecv(0, 1, MakeTag(i, 1, 1), in.data(), bytes));
      r.push_back(w.Isend(0, 1, MakeTag(i, 0, 0), out.data(), bytes));
      s = w.WaitAll(0, r, DefaultDeadline(), "bench");
    } else {
      s = w.Recv(1, 0, MakeTag(i, 0, 0), in.data(), bytes, nullptr, DefaultDeadline(), "bench");
      if (s.ok()) s = w.Send(1, 0, MakeTag(i, 1, 1), out.data(), bytes, DefaultDeadline(), "b");
    }
    if (!s.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, s.message().c_str());
      return -1;
    }
  }
  (void)peer;
  return Seconds(start, Clock::now()) / (2.0 * iters);
}

void Report(const char* what, double small, double large) {
  std::printf("%-28s 4 B one-way %8.1f us   64 MiB one-way %7.1f ms = %6.2f GB/s\n", what,
              small * 1e6, large * 1e3, kLarge / large / 1e9);
}

void Threads() {
  std::string error;
  auto w = UcxWorld::Create(2, {0, 1}, &error);
  if (!w || !w->Connect({w->Address(0), w->Address(1)}, &error)) {
    std::fprintf(stderr, "%s\n", error.c_str());
    return;
  }
  double small = 0, large = 0;
  std::thread t([&] {
    PingPong(*w, 1, kSmall, 3000);
    PingPong(*w, 1, kLarge, 10);
  });
  small = PingPong(*w, 0, kSmall, 3000);
  large = PingPong(*w, 0, kLarge, 10);
  t.join();
  Report((std::string("UCX 2 threads (") + w->wait_mode_name() + ")").c_str(), small, large);
}

void Processes() {
  int fds[2];
  socketpair(AF_UNIX, SOCK_STREAM, 0, fds);
  pid_t child = fork();
  int rank = child == 0 ? 1 : 0;
  int fd = fds[rank];
  std::string error;
  auto w = UcxWorld::Create(2, {rank}, &error);
  std::string mine = w->Address(rank), theirs(4096, 0);
  uint32_t n = mine.size(), m = 0;
  write(fd, &n, 4);
  write(fd, mine.data(), n);
  read(fd, &m, 4);
  theirs.resize(m);
  for (size_t got = 0; got < m;) got += read(fd, theirs.data() + got, m - got);
  std::vector<std::string> all(2);
  all[rank] = mine;
  all[1 - rank] = theirs;
  if (!w->Connect(all, &error)) std::fprintf(stderr, "%s\n", error.c_str());
  double small = PingPong(*w, rank, kSmall, 3000);
  double large = PingPong(*w, rank, kLarge, 10);
  if (child == 0) {
    w.reset();
    _exit(0);
  }
  Report((std::string("UCX 2 processes (") + w->wait_mode_name() + ")").c_str(), small, large);
  waitpid(child, nullptr, 0);
}

// Baseline for a direct in-process path: the sender publishes a pointer in a mailbox, the
// receiver copies (one memcpy, like UCX's single-copy rendezvous) and signals completion.
void Direct() {
  struct Mailbox {
    std::mutex mu;
    std::condition_variable cv;
    const char* data = nullptr;
    size_t bytes = 0;
    bool full = false;
  } box[2];  // box[r] = messages to rank r
  auto send = [&](int to, const char* data, size_t bytes) {
    std::unique_lock<std::mutex> l(box[to].mu);
    box[to].data = data;
    box[to].bytes = bytes;
    box[to].full = true;
    box[to].cv.notify_one();
    box[to].cv.wait(l, [&] { return !box[to].full; });  // sender waits until copied
  };
  auto recv = [&](int me, char* out) {
    std::unique_lock<std::mutex> l(box[me].mu);
    box[me].cv.wait(l, [&] { return box[me].full; });
    std::memcpy(out, box[me].data, box[me].bytes);
    box[me].full = false;
    box[me].cv.notify_one();
  };
  auto run = [&](int rank, size_t bytes, int iters) {
    std::vector<char> out(bytes, 1), in(bytes);
    auto start = Clock::now();
    for (int i = 0; i < iters; ++i) {
      if (rank == 0) {
        send(1, out.data(), bytes);
        recv(0, in.data());
      } else {
        recv(1, in.data());
        send(0, out.data(), bytes);
      }
    }
    return Seconds(start, Clock::now()) / (2.0 * iters);
  };
  std::thread t([&] {
    run(1, kSmall, 3000);
    run(1, kLarge, 10);
  });
  double small = run(0, kSmall, 3000);
  double large = run(0, kLarge, 10);
  t.join();
  Report("direct memcpy 2 threads", small, large);
}

}  // namespace

int main(int argc, char** argv) {
  std::string which = argc > 1 ? argv[1] : "all";
  if (which == "all" || which == "threads") Threads();
  if (which == "all" || which == "procs") Processes();
  if (which == "all" || which == "direct") Direct();
  return 0;
}
