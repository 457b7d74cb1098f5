#include "ffi/engine.h"

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

namespace jaxcomm::collectives {
namespace {

struct Task {
  EngineBody body;
  ffi::Promise promise;
};

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

// Process-wide engine state: the device engines and the stop message.
struct EngineState {
  std::mutex mu;
  std::map<int64_t, DeviceEngine*> devices;
  std::string stop_message;
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
      task.promise.SetError(ffi::Error::Internal(stopped));
      continue;
    }
    ffi::Error error = task.body(RunnerForThisProcess());
    if (error.success()) {
      task.promise.SetAvailable();
    } else {
      task.promise.SetError(std::move(error));
    }
  }
}

}  // namespace

ffi::Future SubmitToEngine(int64_t device_id, EngineBody body) {
  Task task{std::move(body), ffi::Promise()};
  ffi::Future future(task.promise);
  DeviceEngine* engine;
  {
    std::lock_guard<std::mutex> lock(State().mu);
    if (!State().stop_message.empty()) {
      task.promise.SetError(ffi::Error::Internal(State().stop_message));
      return future;
    }
    DeviceEngine*& slot = State().devices[device_id];
    if (slot == nullptr) slot = new DeviceEngine();  // never destroyed, see DeviceEngine
    engine = slot;
  }
  engine->Push(std::move(task));
  return future;
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
