#include "ffi/engine.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <random>
#include <thread>

namespace jaxcomm::collectives {
namespace {

struct Task {
  EngineBody body;
  std::shared_ptr<Completion> completion;
  double queued;  // steady clock seconds when the handler queued it
};

double SteadySeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The queue time of the task this engine thread runs (QueuedSecondsOfCurrentCollective).
thread_local double t_current_queued = 0.0;

// Completes futures off the engine threads. XLA resumes a call's dependents on the thread that
// completes its future; on an engine thread they would delay that device's next collective.
// Never destroyed, like the engines (see DeviceEngine).
class Completer {
 public:
  Completer() : thread_([this] { Loop(); }) { thread_.detach(); }

  void Push(std::vector<ffi::Promise> promises, const ffi::Error& error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& promise : promises) queue_.emplace_back(std::move(promise), error);
    }
    ready_.notify_one();
  }

 private:
  void Loop() {
    for (;;) {
      std::pair<ffi::Promise, ffi::Error> item;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [this] { return !queue_.empty(); });
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      if (item.second.success()) {
        item.first.SetAvailable();
      } else {
        item.first.SetError(std::move(item.second));
      }
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<std::pair<ffi::Promise, ffi::Error>> queue_;
  std::thread thread_;
};

Completer& TheCompleter() {
  static Completer* completer = new Completer();  // leaked on purpose, see DeviceEngine
  return *completer;
}

// One device's queue and the thread that drains it. Never destroyed: the thread may be inside
// a collective when the process exits, and tearing it down from a static destructor would race
// with it. The OS reclaims both.
class DeviceEngine {
 public:
  DeviceEngine() : thread_([this] { Loop(); }) { thread_.detach(); }

  void Push(Task task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    ready_.notify_one();
  }

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Task> queue_;
  std::thread thread_;
};

// The collective of a split call, between its start and its done.
struct Ticket {
  std::shared_ptr<Completion> completion;
  std::vector<const void*> results;
};

// A detached collective, between its start and its wait (engine.h, Handles).
struct Handle {
  int64_t device_id;
  int64_t stream;
  std::shared_ptr<Completion> completion;
  std::shared_ptr<Staging> staging;
};

// Process-wide engine state: the device engines, the stop message, the open tickets and the
// open handles.
struct EngineState {
  std::mutex mu;
  std::map<int64_t, DeviceEngine*> devices;
  std::string stop_message;
  std::map<int32_t, Ticket> tickets;
  int32_t next_ticket = 0;
  std::map<int32_t, Handle> handles;
  std::map<std::pair<int64_t, int64_t>, int32_t> open_by_stream;  // (device, stream) -> handle
  int32_t next_handle = 1;                                        // 0 and below are never handles
};

EngineState& State() {
  static EngineState* state = new EngineState();  // leaked on purpose, see DeviceEngine
  return *state;
}

// Serial when several devices share the process (they already occupy the cores), threaded
// when the process drives one device alone.
kernels::TaskRunner RunnerForThisProcess() {
  std::lock_guard<std::mutex> lock(State().mu);
  if (State().devices.size() > 1) return kernels::RunTasksSerially;
  const unsigned cores = std::thread::hardware_concurrency();
  return cores > 1 ? kernels::ThreadedRunner(static_cast<int>(cores))
                   : kernels::TaskRunner(kernels::RunTasksSerially);
}

void DeviceEngine::Loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ready_.wait(lock, [this] { return !queue_.empty(); });
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    // A stopped engine fails what was queued behind the failure with the same message.
    const std::string stopped = EngineStopMessage();
    if (!stopped.empty()) {
      task.completion->Finish(ffi::Error::Internal(stopped));
      continue;
    }
    t_current_queued = task.queued;
    task.completion->Finish(task.body(RunnerForThisProcess()));
    t_current_queued = 0.0;
  }
}

}  // namespace

ffi::Future CompletedFuture(const ffi::Error& error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (error.success()) {
    promise.SetAvailable();
  } else {
    promise.SetError(error);
  }
  return future;
}

ffi::Future Completion::Wait() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return CompletedFuture(error_);
  ffi::Promise promise;
  ffi::Future future(promise);
  waiters_.push_back(std::move(promise));
  return future;
}

void Completion::Finish(ffi::Error error) {
  std::vector<ffi::Promise> waiters;
  {
    std::lock_guard<std::mutex> lock(mu_);
    finished_ = true;
    error_ = error;
    waiters.swap(waiters_);
  }
  if (!waiters.empty()) TheCompleter().Push(std::move(waiters), error);
}

ffi::Error Completion::Status() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!finished_) {
    return ffi::Error::Internal("jaxcomm engine: a collective's status was read before it ended");
  }
  return error_;
}

std::shared_ptr<Completion> SubmitToEngine(int64_t device_id, EngineBody body) {
  auto completion = std::make_shared<Completion>();
  DeviceEngine* engine;
  {
    std::lock_guard<std::mutex> lock(State().mu);
    if (!State().stop_message.empty()) {
      completion->Finish(ffi::Error::Internal(State().stop_message));
      return completion;
    }
    DeviceEngine*& slot = State().devices[device_id];
    if (slot == nullptr) slot = new DeviceEngine();  // never destroyed, see DeviceEngine
    engine = slot;
  }
  engine->Push(Task{std::move(body), completion, SteadySeconds()});
  return completion;
}

double QueuedSecondsOfCurrentCollective() { return t_current_queued; }

int32_t IssueTicket(std::shared_ptr<Completion> completion, std::vector<const void*> results) {
  std::lock_guard<std::mutex> lock(State().mu);
  // Tickets wrap around after 2^31 calls; a ticket is redeemed within its step, long before.
  int32_t ticket = State().next_ticket;
  State().next_ticket = ticket == std::numeric_limits<int32_t>::max() ? 0 : ticket + 1;
  State().tickets[ticket] = Ticket{std::move(completion), std::move(results)};
  return ticket;
}

ffi::Error RedeemTicket(int32_t ticket, const std::vector<const void*>& results,
                        std::shared_ptr<Completion>* completion) {
  std::lock_guard<std::mutex> lock(State().mu);
  auto it = State().tickets.find(ticket);
  if (it == State().tickets.end()) {
    return ffi::Error::Internal("jaxcomm_collective_done: ticket " + std::to_string(ticket) +
                                " belongs to no started collective (each done must follow its "
                                "own start, once)");
  }
  if (it->second.results != results) {
    return ffi::Error::Internal(
        "jaxcomm_collective_done: XLA handed done other buffers than the ones its collective "
        "writes (it copied a result between start and done); please report this with the "
        "program's HLO");
  }
  *completion = std::move(it->second.completion);
  State().tickets.erase(it);
  return ffi::Error::Success();
}

namespace {
// The error of a detached start on a stream whose last handle is open. Caller holds State().mu.
ffi::Error StreamFreeLocked(int64_t device_id, int64_t stream) {
  auto open = State().open_by_stream.find({device_id, stream});
  if (open != State().open_by_stream.end()) {
    return ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jaxcomm detached collective: handle " + std::to_string(open->second) + " of stream " +
            std::to_string(stream) + " on device " + std::to_string(device_id) +
            " was never waited, and a new start on that stream came; wait every handle "
            "(jaxcomm.wait) before starting the next one on its stream");
  }
  return ffi::Error::Success();
}
}  // namespace

ffi::Error CheckStreamFree(int64_t device_id, int64_t stream) {
  std::lock_guard<std::mutex> lock(State().mu);
  return StreamFreeLocked(device_id, stream);
}

ffi::Error IssueHandle(int64_t device_id, int64_t stream, std::shared_ptr<Completion> completion,
                       std::shared_ptr<Staging> staging, int32_t* handle) {
  std::lock_guard<std::mutex> lock(State().mu);
  const ffi::Error free = StreamFreeLocked(device_id, stream);
  if (!free.success()) return free;
  if (State().next_handle == std::numeric_limits<int32_t>::max()) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "jaxcomm detached collective: out of handles");
  }
  *handle = State().next_handle++;
  State().handles[*handle] = Handle{device_id, stream, std::move(completion), std::move(staging)};
  State().open_by_stream[{device_id, stream}] = *handle;
  return ffi::Error::Success();
}

ffi::Error RedeemHandle(int32_t handle, int64_t device_id, std::shared_ptr<Completion>* completion,
                        std::shared_ptr<Staging>* staging) {
  std::lock_guard<std::mutex> lock(State().mu);
  auto it = State().handles.find(handle);
  if (it == State().handles.end()) {
    if (handle >= 1 && handle < State().next_handle) {
      return ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          "jaxcomm.wait: handle " + std::to_string(handle) +
              " was waited already (each handle is waited once), or it comes from another process "
              "(a checkpoint saved while its collective was in flight)");
    }
    return ffi::Error::InvalidArgument("jaxcomm.wait: handle " + std::to_string(handle) +
                                       " was never started (not a handle)");
  }
  if (it->second.device_id != device_id) {
    return ffi::Error::InvalidArgument(
        "jaxcomm.wait: handle " + std::to_string(handle) + " was started on device " +
        std::to_string(it->second.device_id) + " and waited on device " +
        std::to_string(device_id) + "; keep handles sharded like the data (one per rank)");
  }
  *completion = std::move(it->second.completion);
  *staging = std::move(it->second.staging);
  State().open_by_stream.erase({it->second.device_id, it->second.stream});
  State().handles.erase(it);
  return ffi::Error::Success();
}

int32_t ProcessEpoch() {
  static const int32_t epoch = [] {
    std::random_device device;
    std::uniform_int_distribution<int32_t> draw(1, std::numeric_limits<int32_t>::max());
    return draw(device);
  }();
  return epoch;
}

std::vector<std::string> OpenHandles() {
  std::lock_guard<std::mutex> lock(State().mu);
  std::vector<std::string> lines;
  for (const auto& [handle, h] : State().handles) {
    lines.push_back("handle " + std::to_string(handle) + " (device " + std::to_string(h.device_id) +
                    ", stream " + std::to_string(h.stream) + ")");
  }
  return lines;
}

std::string StopEngine(const std::string& message) {
  std::lock_guard<std::mutex> lock(State().mu);
  if (State().stop_message.empty()) State().stop_message = message;
  return State().stop_message;
}

std::string EngineStopMessage() {
  std::lock_guard<std::mutex> lock(State().mu);
  return State().stop_message;
}

}  // namespace jaxcomm::collectives
