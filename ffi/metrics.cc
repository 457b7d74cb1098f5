#include "ffi/metrics.h"

#include <deque>
#include <map>
#include <mutex>
#include <tuple>

#include "ffi/common.h"

namespace jaxcomm::collectives {
namespace {

// The sums of one (world rank, name, algorithm) over its calls.
struct MetricsTotal {
  uint64_t calls = 0, bytes_sent = 0, bytes_received = 0, dense_bytes_sent = 0, elements = 0;
  double seconds = 0;
  int group_size = 0;  // of the last call
};

constexpr size_t kMaxRecentRecords = 4096;

std::mutex g_metrics_mu;
std::map<std::tuple<int, std::string, std::string>, MetricsTotal> g_totals;
std::deque<MetricsRecord> g_recent;

}  // namespace

void RecordMetrics(MetricsRecord record) {
  std::lock_guard<std::mutex> lock(g_metrics_mu);
  MetricsTotal& total = g_totals[{record.world_rank, record.name, record.algorithm}];
  total.calls += 1;
  total.bytes_sent += record.bytes_sent;
  total.bytes_received += record.bytes_received;
  total.dense_bytes_sent += record.dense_bytes_sent;
  total.elements += static_cast<uint64_t>(record.elements);
  total.seconds += record.seconds;
  total.group_size = record.group_size;
  g_recent.push_back(std::move(record));
  if (g_recent.size() > kMaxRecentRecords) g_recent.pop_front();
}

std::string MetricsJson() {
  std::lock_guard<std::mutex> lock(g_metrics_mu);
  ffi_common::TextBuilder out;
  out << "{\"totals\": [";
  bool first = true;
  for (const auto& [key, total] : g_totals) {
    out << (first ? "" : ", ") << "{\"world_rank\": " << std::get<0>(key) << ", \"name\": \""
        << std::get<1>(key) << "\", \"algorithm\": \"" << std::get<2>(key)
        << "\", \"calls\": " << total.calls << ", \"group_size\": " << total.group_size
        << ", \"elements\": " << total.elements << ", \"bytes_sent\": " << total.bytes_sent
        << ", \"bytes_received\": " << total.bytes_received
        << ", \"dense_bytes_sent\": " << total.dense_bytes_sent
        << ", \"seconds\": " << total.seconds << "}";
    first = false;
  }
  out << "], \"recent\": [";
  first = true;
  for (const MetricsRecord& r : g_recent) {
    out << (first ? "" : ", ") << "{\"world_rank\": " << r.world_rank << ", \"name\": \"" << r.name
        << "\", \"algorithm\": \"" << r.algorithm << "\", \"seq\": " << r.seq
        << ", \"group_size\": " << r.group_size << ", \"elements\": " << r.elements
        << ", \"bytes_sent\": " << r.bytes_sent << ", \"bytes_received\": " << r.bytes_received
        << ", \"dense_bytes_sent\": " << r.dense_bytes_sent << ", \"seconds\": " << r.seconds
        << ", \"queued\": " << r.queued << ", \"started\": " << r.started
        << ", \"finished\": " << r.finished << ", \"wait_seconds\": " << r.wait_seconds
        << ", \"reduce_seconds\": " << r.reduce_seconds << ", \"copy_seconds\": " << r.copy_seconds
        << ", \"cpu_seconds\": " << r.cpu_seconds << ", \"phases\": {";
    for (size_t i = 0; i < r.phases.size(); ++i) {
      out << (i ? ", " : "") << "\"" << r.phases[i].first << "\": " << r.phases[i].second;
    }
    out << "}}";
    first = false;
  }
  out << "]}";
  return out.str();
}

void ResetMetrics() {
  std::lock_guard<std::mutex> lock(g_metrics_mu);
  g_totals.clear();
  g_recent.clear();
}

}  // namespace jaxcomm::collectives

// ctypes entry points for jaxcomm.metrics(): copy the JSON into `buffer` and return its full
// length (call again with a larger buffer when the return value >= capacity).
JAXCOMM_C_API int64_t jaxcomm_metrics_json(char* buffer, int64_t capacity) {
  return jaxcomm::ffi_common::CopyJson(jaxcomm::collectives::MetricsJson(), buffer, capacity);
}

JAXCOMM_C_API void jaxcomm_metrics_reset() { jaxcomm::collectives::ResetMetrics(); }
