// GPU buffers over a host transport (UCX): the dense allreduce of device memory, host-staged
// and stream-ordered, for JAXCOMM_TRANSPORT=ucx on GPU (the registry's "ucx" row accepts
// device buffers through this path).
//
// On XLA's stream the handler enqueues: a copy of x into pinned host memory, an event, a wait
// for a host-written flag (cuStreamWaitValue64), and a copy of the pinned result into out.
// It then queues the CPU schedule (ffi/allreduce.h DenseAllreduce, the same code, order and
// bits as a CPU world) on the device's engine thread (ffi/engine.h) and returns: XLA's
// dispatch thread never waits for the wire. The engine waits for the event, runs the
// schedule over the world's transport, and writes the call's number into the flag, which
// releases the stream. Whatever happens to the engine's work (an error, an engine stopped by
// an earlier failure), the flag is written, so the stream never waits forever; a failed
// call's result is NaN, and its error stops the engine (ffi/engine.h), so the later calls
// fail naming it.
//
// The staging buffers belong to the (device, stream) pair and are reused in stream order
// (the next call's copy in runs after this call's copy out, and the engine runs one device's
// calls in order); they grow, after a stream synchronize, when a longer vector comes.
#pragma once

#include <cuda_runtime_api.h>

#include "ffi/cuda/gpu_collective.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives::gpu {

// Whether JAXCOMM_TRANSPORT moves this process's GPU buffers host-staged (ucx), as read by
// ffi/transport/registry.h SelectedTransport.
bool HostStagedSelected();

// Enqueues on `stream` the dense allreduce of x[0, n) into out[0, n) (file comment).
ffi::Error HostStagedAllreduce(const char* op, cudaStream_t stream, const Caller& caller,
                               const float* x, float* out, int64_t n);

}  // namespace jaxcomm::collectives::gpu
