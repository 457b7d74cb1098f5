#include "ffi/cuda/host_staged.h"

#include <cuda.h>  // the driver's types only: its entry points are found at run time

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ffi/allreduce.h"
#include "ffi/engine.h"
#include "ffi/transport/registry.h"

namespace jaxcomm::collectives::gpu {
namespace {

using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);

// cuStreamWaitValue64 of the driver the process loaded, through the runtime (libjaxcomm_ffi.so
// links no libcuda).
ffi::Error LoadWaitValue64(const char* op, WaitValue64* out) {
  static std::once_flag once;
  static WaitValue64 loaded = nullptr;
  static cudaError_t error = cudaSuccess;
  std::call_once(once, [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    error = cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &entry, 12000,
                                             cudaEnableDefault, &found);
    if (error == cudaSuccess && found != cudaDriverEntryPointSuccess) {
      error = cudaErrorSymbolNotFound;
    }
    loaded = reinterpret_cast<WaitValue64>(entry);
  });
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(op, error, "finding cuStreamWaitValue64"));
  *out = loaded;
  return ffi::Error::Success();
}

// Pinned staging memory of one (device, stream): the input and the result, and the flag the
// stream waits on. Only the dispatch thread of the stream changes it (under `mutex`); the
// engine gets the pointers of its call.
struct Stage {
  std::mutex mutex;
  float* in = nullptr;
  float* out = nullptr;
  int64_t capacity = 0;      // floats, each way
  uint64_t* flag = nullptr;  // host-mapped; call i is released once it holds >= i
  CUdeviceptr flag_device = 0;
  uint64_t enqueued = 0;  // calls enqueued so far
};

Stage& StageOf(int ordinal, cudaStream_t stream) {
  static std::mutex mutex;
  static auto* stages = new std::map<std::pair<int, cudaStream_t>, std::unique_ptr<Stage>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<Stage>& slot = (*stages)[{ordinal, stream}];
  if (!slot) slot = std::make_unique<Stage>();
  return *slot;
}

// Makes `s` hold n floats each way and its flag exist. Growing first lets the stream's
// earlier calls finish (their copies and the engine's work use the old buffers).
ffi::Error Reserve(const char* op, Stage& s, cudaStream_t stream, int64_t n) {
  if (s.flag == nullptr) {
    void* flag = nullptr;
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(op, cudaHostAlloc(&flag, sizeof(uint64_t), cudaHostAllocMapped), "pinning"));
    std::memset(flag, 0, sizeof(uint64_t));
    void* device = nullptr;
    JAXCOMM_RETURN_IF_ERROR(
        CheckCuda(op, cudaHostGetDevicePointer(&device, flag, 0), "mapping the flag"));
    s.flag = static_cast<uint64_t*>(flag);
    s.flag_device = reinterpret_cast<CUdeviceptr>(device);
  }
  if (n <= s.capacity) return ffi::Error::Success();
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(op, cudaStreamSynchronize(stream), "growing the staging"));
  cudaFreeHost(s.in);
  cudaFreeHost(s.out);
  s.in = s.out = nullptr;
  s.capacity = 0;
  const size_t bytes = sizeof(float) * static_cast<size_t>(n);
  void* in = nullptr;
  void* out = nullptr;
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(op, cudaHostAlloc(&in, bytes, 0), "pinning the staging"));
  s.in = static_cast<float*>(in);
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(op, cudaHostAlloc(&out, bytes, 0), "pinning the staging"));
  s.out = static_cast<float*>(out);
  s.capacity = n;
  return ffi::Error::Success();
}

// Releases the stream's wait for call `seq` exactly once, however the engine's work ends: with
// the result (Finish(true)) or NaN (a failure, or an engine that dropped the work).
class Release {
 public:
  Release(uint64_t* flag, uint64_t seq, float* out, int64_t n)
      : flag_(flag), seq_(seq), out_(out), n_(n) {}
  ~Release() { Finish(false); }
  Release(const Release&) = delete;
  Release& operator=(const Release&) = delete;

  void Finish(bool ok) {
    if (finished_) return;
    finished_ = true;
    if (!ok) std::fill(out_, out_ + n_, std::numeric_limits<float>::quiet_NaN());
    // The engine runs one device's calls in order, so the flag only grows.
    __atomic_store_n(flag_, seq_, __ATOMIC_RELEASE);
  }

 private:
  uint64_t* flag_;
  uint64_t seq_;
  float* out_;
  int64_t n_;
  bool finished_ = false;
};

// The call site, owned (the call frame is gone when the engine runs).
struct KeptSite {
  explicit KeptSite(const GpuSite& gpu)
      : site(gpu.site),
        world_devices(gpu.site.world_devices.begin(), gpu.site.world_devices.end()),
        mesh_axis_sizes(gpu.site.mesh_axis_sizes.begin(), gpu.site.mesh_axis_sizes.end()),
        reduce_axes(gpu.site.reduce_axes.begin(), gpu.site.reduce_axes.end()),
        coordinates(gpu.coordinates) {
    site.world_devices = ffi::Span<const int64_t>(world_devices.data(), world_devices.size());
    site.mesh_axis_sizes = ffi::Span<const int64_t>(mesh_axis_sizes.data(), mesh_axis_sizes.size());
    site.reduce_axes = ffi::Span<const int64_t>(reduce_axes.data(), reduce_axes.size());
    site.coordinates = coordinates.data();
  }
  CallSite site;
  std::vector<int64_t> world_devices, mesh_axis_sizes, reduce_axes;
  std::vector<int32_t> coordinates;
};

// Enqueues the stream's side of call `seq`: x to the pinned input, `ready`, the wait for the
// flag, the pinned result to out.
ffi::Error EnqueueStaging(const char* op, cudaStream_t stream, WaitValue64 wait, const Stage& s,
                          uint64_t seq, const float* x, float* out, int64_t n, cudaEvent_t ready) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(n);
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(
      op, cudaMemcpyAsync(s.in, x, bytes, cudaMemcpyDeviceToHost, stream), "copy to host"));
  JAXCOMM_RETURN_IF_ERROR(CheckCuda(op, cudaEventRecord(ready, stream), "cudaEventRecord"));
  const CUresult waited =
      wait(reinterpret_cast<CUstream>(stream), s.flag_device, seq, CU_STREAM_WAIT_VALUE_GEQ);
  if (waited != CUDA_SUCCESS) {
    return ffi::Error::Internal(std::string(op) + ": cuStreamWaitValue64 failed with CUresult " +
                                std::to_string(static_cast<int>(waited)));
  }
  return CheckCuda(op, cudaMemcpyAsync(out, s.out, bytes, cudaMemcpyHostToDevice, stream),
                   "copy to device");
}

}  // namespace

bool HostStagedSelected() {
  const transport::Selection& chosen = transport::SelectedTransport(transport::MemoryKind::kDevice);
  return chosen.entry != nullptr && std::strcmp(chosen.entry->name, "ucx") == 0;
}

ffi::Error HostStagedAllreduce(const char* op, cudaStream_t stream, const Caller& caller,
                               const float* x, float* out, int64_t n) {
  // After a transport failure nothing runs on the engine: fail here, where XLA sees it.
  if (const std::string stopped = EngineStopMessage(); !stopped.empty()) {
    return ffi::Error::Internal(std::string(op) + ": " + stopped);
  }
  WaitValue64 wait = nullptr;
  JAXCOMM_RETURN_IF_ERROR(LoadWaitValue64(op, &wait));
  GpuSite gpu;
  JAXCOMM_RETURN_IF_ERROR(ResolveGpuSite(op, stream, caller, &gpu));
  auto kept = std::make_shared<KeptSite>(gpu);
  Stage& s = StageOf(gpu.device_ordinal, stream);
  std::lock_guard<std::mutex> lock(s.mutex);
  JAXCOMM_RETURN_IF_ERROR(Reserve(op, s, stream, std::max<int64_t>(n, 1)));
  cudaEvent_t ready = nullptr;
  JAXCOMM_RETURN_IF_ERROR(
      CheckCuda(op, cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "cudaEventCreate"));
  // From here on the engine's task releases the stream, in call order, whatever happens.
  const uint64_t seq = ++s.enqueued;
  auto release = std::make_shared<Release>(s.flag, seq, s.out, n);
  const ffi::Error enqueued = EnqueueStaging(op, stream, wait, s, seq, x, out, n, ready);
  const std::string failure = enqueued.success() ? "" : std::string(enqueued.message());
  float* in = s.in;
  float* result = s.out;
  const int ordinal = gpu.device_ordinal;
  // Destroyed with the engine's task, run or dropped.
  const std::shared_ptr<CUevent_st> event(ready, cudaEventDestroy);
  auto run = [=]() -> ffi::Error {
    if (!failure.empty()) return ffi::Error::Internal(failure);
    cudaSetDevice(ordinal);
    const cudaError_t copied = cudaEventSynchronize(event.get());
    JAXCOMM_RETURN_IF_ERROR(CheckCuda(op, copied, "waiting for the copy to host"));
    std::unique_ptr<Group> group;
    JAXCOMM_RETURN_IF_ERROR(Group::Begin(kept->site, &group));
    thread_local std::vector<float> scratch;
    const char* algorithm = nullptr;
    JAXCOMM_RETURN_IF_ERROR(DenseAllreduce(*group, in, result, n, &scratch, &algorithm));
    release->Finish(true);
    group->Finish(algorithm, n);
    return ffi::Error::Success();
  };
  SubmitToEngine(gpu.site.device_id, [run, op](const kernels::TaskRunner&) -> ffi::Error {
    // Nobody waits for this task: its error (the result is NaN) fails the later calls.
    ffi::Error error = run();
    if (!error.success()) StopEngine(std::string(op) + ": " + std::string(error.message()));
    return error;
  });
  return enqueued;
}

}  // namespace jaxcomm::collectives::gpu
