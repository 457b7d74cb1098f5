// Task parallelism for kernels without depending on any runtime.
//
// Kernels receive a TaskRunner from their caller (the FFI layer adapts XLA's intra-op thread
// pool to it; tests and benchmarks use RunTasksSerially or RunTasksOnThreads). Kernels split
// work into independent tasks whose results they combine in task order, so the output never
// depends on how many threads ran them.
#pragma once

#include <cstdint>
#include <functional>

namespace jaxcomm::kernels {

// The kernels split work into at most kMaxTasks tasks of at least kMinElementsPerTask elements
// (adaptive.cc splits finer), so small inputs stay on one thread.
constexpr int kMaxTasks = 64;
constexpr int64_t kMinElementsPerTask = 1 << 18;

// Runs task(0), ..., task(num_tasks - 1), possibly concurrently, and returns once all finished.
using TaskRunner = std::function<void(int num_tasks, const std::function<void(int)>& task)>;

// Runs every task on the calling thread.
void RunTasksSerially(int num_tasks, const std::function<void(int)>& task);

// Runs tasks on up to `num_threads` std::threads (the caller included). For tests and benchmarks.
TaskRunner ThreadedRunner(int num_threads);

// How many tasks to split `n` elements into so each task gets at least `min_per_task`.
int NumTasksFor(int64_t n, int64_t min_per_task, int max_tasks);

// Half-open range [begin, end) of task `task` out of `num_tasks` over `n` elements, aligned
// to `align` elements so tasks never share a packed word.
struct Range {
  int64_t begin;
  int64_t end;
};
Range TaskRange(int64_t n, int num_tasks, int task, int64_t align = 1);

}  // namespace jaxcomm::kernels
