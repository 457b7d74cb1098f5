#include "ffi/common.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace jaxcomm::ffi_common {

kernels::TaskRunner PoolRunner(ffi::ThreadPool* pool) {
  return [pool](int num_tasks, const std::function<void(int)>& task) {
    const int64_t pool_threads = pool ? pool->num_threads() : 0;
    if (num_tasks <= 1 || pool_threads <= 0) {
      kernels::RunTasksSerially(num_tasks, task);
      return;
    }
    struct State {
      std::atomic<int> next{0};
      std::atomic<int> finished{0};
      std::mutex mu;
      std::condition_variable all_finished;
    };
    auto state = std::make_shared<State>();
    const std::function<void(int)>* task_ptr = &task;
    // Helpers that start after every task was claimed exit without touching `task`, which
    // may be gone by then; the shared state outlives them.
    auto work = [state, task_ptr, num_tasks] {
      for (int t = state->next.fetch_add(1); t < num_tasks; t = state->next.fetch_add(1)) {
        (*task_ptr)(t);
        if (state->finished.fetch_add(1) + 1 == num_tasks) {
          std::lock_guard<std::mutex> lock(state->mu);
          state->all_finished.notify_all();
        }
      }
    };
    const int helpers = static_cast<int>(std::min<int64_t>(pool_threads, num_tasks - 1));
    for (int i = 0; i < helpers; ++i) {
      auto copy = work;  // Schedule takes ownership of its own copy
      pool->Schedule(std::move(copy));
    }
    work();
    std::unique_lock<std::mutex> lock(state->mu);
    state->all_finished.wait(lock, [&] { return state->finished.load() == num_tasks; });
  };
}

int64_t CopyJson(const std::string& json, char* buffer, int64_t capacity) {
  if (buffer && capacity > 0) {
    const size_t n = std::min<size_t>(json.size(), static_cast<size_t>(capacity - 1));
    json.copy(buffer, n);
    buffer[n] = '\0';
  }
  return static_cast<int64_t>(json.size());
}

}  // namespace jaxcomm::ffi_common
