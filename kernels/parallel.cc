#include "kernels/parallel.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace jaxcomm::kernels {

void RunTasksSerially(int num_tasks, const std::function<void(int)>& task) {
  for (int t = 0; t < num_tasks; ++t) task(t);
}

TaskRunner ThreadedRunner(int num_threads) {
  return [num_threads](int num_tasks, const std::function<void(int)>& task) {
    std::atomic<int> next{0};
    auto worker = [&] {
      for (int t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) task(t);
    };
    std::vector<std::thread> threads;
    for (int i = 1; i < std::min(num_threads, num_tasks); ++i) threads.emplace_back(worker);
    worker();
    for (auto& thread : threads) thread.join();
  };
}

int NumTasksFor(int64_t n, int64_t min_per_task, int max_tasks) {
  if (n <= min_per_task || max_tasks <= 1) return 1;
  return static_cast<int>(std::min<int64_t>(max_tasks, n / min_per_task));
}

Range TaskRange(int64_t n, int num_tasks, int task, int64_t align) {
  const int64_t units = (n + align - 1) / align;
  const int64_t per_task = units / num_tasks;
  const int64_t extra = units % num_tasks;
  const int64_t begin_unit = task * per_task + std::min<int64_t>(task, extra);
  const int64_t end_unit = begin_unit + per_task + (task < extra ? 1 : 0);
  return {std::min(n, begin_unit * align), std::min(n, end_unit * align)};
}

}  // namespace jaxcomm::kernels
