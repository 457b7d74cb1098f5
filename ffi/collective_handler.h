// The bindings every collective handler shares, so each op file only adds its own buffers.
#pragma once

#include <memory>
#include <string>

#include "ffi/common.h"
#include "ffi/group.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

// Binds, in order: Ctx<ThreadPool>, Ctx<DeviceOrdinal>, Arg coordinates (S32[axes]), Arg token
// (S32[]), Attr world, world_devices, mesh_axis_sizes, reduce_axes. Each handler then adds its data
// arguments and results.
inline auto BindCollective() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()           // intra-op threads for local kernels
      .Ctx<ffi::DeviceOrdinal>()        // global device id (CPU): finds our world rank
      .Arg<ffi::Buffer<ffi::S32, 1>>()  // coordinates: lax.axis_index of each mesh axis
      .Arg<ffi::Buffer<ffi::S32, 0>>()  // token: orders collectives (jaxcomm/_ordering.py)
      .Attr<int64_t>("world")           // handle from jaxcomm/_world.py
      .Attr<ffi::Span<const int64_t>>("world_devices")    // device ids in world-rank order
      .Attr<ffi::Span<const int64_t>>("mesh_axis_sizes")  // sizes of the manual mesh axes
      .Attr<ffi::Span<const int64_t>>("reduce_axes");     // 1 for each reduced axis
}

inline CallSite MakeCallSite(const char* name, int32_t device_id,
                             ffi::Buffer<ffi::S32, 1> coordinates, int64_t world,
                             ffi::Span<const int64_t> world_devices,
                             ffi::Span<const int64_t> mesh_axis_sizes,
                             ffi::Span<const int64_t> reduce_axes) {
  return CallSite{name,
                  world,
                  device_id,
                  world_devices,
                  mesh_axis_sizes,
                  reduce_axes,
                  coordinates.typed_data(),
                  static_cast<int64_t>(coordinates.element_count())};
}

// The argument rules of the sparse (top-k based) collectives, on CPU and GPU: x, residual and
// both results hold n elements, and 1 <= k <= n.
inline ffi::Error CheckSparseArguments(const char* name, int64_t k, size_t n, size_t residual,
                                       size_t summed, size_t new_residual) {
  if (residual != n || summed != n || new_residual != n) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": x, residual and results must have one size");
  }
  if (k < 1 || k > static_cast<int64_t>(n)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": k must be in [1, x.size]");
  }
  return ffi::Error::Success();
}

// Shared opening of the sparse collectives on CPU: CheckSparseArguments, then the group.
inline ffi::Error BeginSparseCollective(const CallSite& site, int64_t k,
                                        const ffi::Buffer<ffi::F32>& x,
                                        const ffi::Buffer<ffi::F32>& residual,
                                        ffi::ResultBuffer<ffi::F32>& summed,
                                        ffi::ResultBuffer<ffi::F32>& new_residual,
                                        std::unique_ptr<Group>* group) {
  JAXCOMM_RETURN_IF_ERROR(CheckSparseArguments(site.name, k, x.element_count(),
                                               residual.element_count(), summed->element_count(),
                                               new_residual->element_count()));
  return Group::Begin(site, group);
}

}  // namespace jaxcomm::collectives
