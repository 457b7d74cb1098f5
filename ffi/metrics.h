// The process-wide store of collective metrics behind jaxcomm.metrics(): totals per (world
// rank, collective, algorithm) and the most recent calls, read as JSON through ctypes
// (jaxcomm_metrics_json). Group::Finish (ffi/group.h) records every call here.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace jaxcomm::collectives {

// One finished collective call, as jaxcomm.metrics()["recent"] lists it.
struct MetricsRecord {
  int world_rank;
  std::string name;       // Python API name, e.g. "jaxcomm.allreduce"
  std::string algorithm;  // the schedule that ran, e.g. "dense_direct"
  uint32_t seq;
  int group_size;
  int64_t elements;
  uint64_t bytes_sent;
  uint64_t bytes_received;
  uint64_t dense_bytes_sent;  // what a dense float32 schedule would have sent
  double seconds;
  double queued;    // steady clock, seconds (= Python's time.monotonic()): handler ran
  double started;   // engine started it (queued <= started; queued = started off the engine)
  double finished;  // likewise
  double wait_seconds, reduce_seconds, copy_seconds;
  double cpu_seconds;  // CPU time of the thread that ran it (the engine's, waiting included)
  std::vector<std::pair<const char*, double>> phases;  // algorithm phase -> seconds
};

// Adds `record` to the totals and to the recent calls (the last kMaxRecentRecords are kept).
void RecordMetrics(MetricsRecord record);
// Metrics of every collective this process ran, as JSON (see jaxcomm.metrics()).
std::string MetricsJson();
void ResetMetrics();

}  // namespace jaxcomm::collectives
