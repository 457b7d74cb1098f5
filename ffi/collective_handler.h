// The bindings every collective handler shares, so each op file only adds its own buffers.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "ffi/common.h"
#include "ffi/engine.h"
#include "ffi/group.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {

// What every collective call says about its world and mesh: one dictionary attribute,
// "collective", built by jaxcomm/collectives/_call.py and decoded once (CPU and GPU alike).
struct CollectiveAttrs {
  int64_t world;                             // handle from jaxcomm/_world.py
  ffi::Span<const int64_t> world_devices;    // device ids in world-rank order
  ffi::Span<const int64_t> mesh_axis_sizes;  // sizes of the manual mesh axes
  ffi::Span<const int64_t> reduce_axes;      // 1 for each reduced axis
  bool split;      // start only: jaxcomm_collective_done waits (CPU; ffi/engine.h, Tickets)
  int64_t detach;  // > 0: detached start on this stream, jaxcomm_handle_wait waits (CPU;
                   // ffi/engine.h, Handles); 0: not detached
};

// The mesh roles of a hierarchical allreduce (dense or quantized, CPU and GPU): one dictionary
// attribute, "hierarchy", built by jaxcomm/collectives/_attributes.py (hierarchical_attributes).
struct HierarchyAttrs {
  int64_t node_axis;   // index of the node axis among the manual mesh axes
  int64_t local_axis;  // index of the local axis
  int64_t leaders;     // 1 = single leader, else L
};

}  // namespace jaxcomm::collectives

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jaxcomm::collectives::CollectiveAttrs, ::xla::ffi::StructMember<int64_t>("world"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("world_devices"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("mesh_axis_sizes"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("reduce_axes"),
    ::xla::ffi::StructMember<bool>("split"), ::xla::ffi::StructMember<int64_t>("detach"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jaxcomm::collectives::HierarchyAttrs,
                                      ::xla::ffi::StructMember<int64_t>("node_axis"),
                                      ::xla::ffi::StructMember<int64_t>("local_axis"),
                                      ::xla::ffi::StructMember<int64_t>("leaders"));

namespace jaxcomm::collectives {

// CollectiveAttrs kept past the handler for the engine (its spans point into the call frame).
template <>
struct Kept<CollectiveAttrs> {
  explicit Kept(const CollectiveAttrs& attrs)
      : world(attrs.world),
        world_devices(attrs.world_devices),
        mesh_axis_sizes(attrs.mesh_axis_sizes),
        reduce_axes(attrs.reduce_axes),
        split(attrs.split),
        detach(attrs.detach) {}
  CollectiveAttrs view() const {
    return {world, world_devices.view(), mesh_axis_sizes.view(), reduce_axes.view(), split, detach};
  }
  int64_t world;
  Kept<ffi::Span<const int64_t>> world_devices, mesh_axis_sizes, reduce_axes;
  bool split;
  int64_t detach;
};

// Who makes a collective call: its device, its mesh coordinates and the world and mesh layout
// (with the op's name, what Group::Begin needs: MakeCallSite). The common operands of every
// collective, CPU and GPU, handed to its implementation as one value.
struct Caller {
  int32_t device_id;                     // global device id (CPU) or local CUDA ordinal (GPU)
  ffi::Buffer<ffi::S32, 1> coordinates;  // lax.axis_index of each mesh axis
  CollectiveAttrs attrs;
};

// Turns a blocking collective implementation
//   ffi::Error Impl(const kernels::TaskRunner&, const Caller&, Data...)
// into the asynchronous CPU handler
//   ffi::Future Handler(ffi::ThreadPool, int32_t device_id, coordinates, token,
//                       const CollectiveAttrs&, Data..., token_out)
// that runs Impl on the device's engine thread. Impl is written as a plain blocking algorithm;
// only the engine ever runs it. The handler writes the token result itself: the next call's
// ordering needs it at once, a split call's token is its ticket, and a detached call's token is
// its handle (ffi/engine.h, Handles).
template <auto Impl, typename Signature = decltype(Impl)>
struct AsyncCollective;

template <auto Impl, typename... Data>
struct AsyncCollective<Impl, ffi::Error (*)(const kernels::TaskRunner&, const Caller&, Data...)> {
  static ffi::Future Handler(ffi::ThreadPool /*pool*/, int32_t device_id,
                             ffi::Buffer<ffi::S32, 1> coordinates, ffi::Buffer<ffi::S32, 0> token,
                             const CollectiveAttrs& attrs, Data... data,
                             ffi::Result<ffi::Buffer<ffi::S32, 0>> token_out) {
    auto kept =
        std::make_shared<std::tuple<Kept<ffi::Buffer<ffi::S32, 1>>, Kept<CollectiveAttrs>,
                                    Kept<std::decay_t<Data>>...>>(coordinates, attrs, data...);
    std::shared_ptr<Staging> staging;
    if (attrs.detach != 0) {
      if (attrs.split || attrs.detach < 0) {
        return CompletedFuture(ffi::Error::InvalidArgument(
            "a detached jaxcomm collective takes a stream id > 0 and cannot also be split"));
      }
      const ffi::Error free = CheckStreamFree(device_id, attrs.detach);
      if (!free.success()) return CompletedFuture(free);
      // Before the engine can see the collective: it must never touch XLA's buffers, which
      // XLA frees or reuses once this jitted call returns.
      staging = std::make_shared<Staging>();
      std::apply(
          [&](auto&... k) {
            auto stage = [&](auto& one) {
              if constexpr (StagedWhenDetached<std::decay_t<decltype(one)>>::value) {
                one.Stage(*staging);
              }
            };
            (stage(k), ...);
          },
          *kept);
    }
    std::shared_ptr<Completion> completion =
        SubmitToEngine(device_id, [device_id, kept](const kernels::TaskRunner& run) {
          return std::apply(
              [&](const auto& kept_coordinates, const auto& kept_attrs, const auto&... k) {
                return Impl(run, Caller{device_id, kept_coordinates.view(), kept_attrs.view()},
                            k.view()...);
              },
              *kept);
        });
    if (staging != nullptr) {
      int32_t handle = 0;
      // A refused handle still has its collective queued (the peers run theirs): it ends on
      // the engine and is dropped; this call fails with the reason.
      const ffi::Error issued =
          IssueHandle(device_id, attrs.detach, std::move(completion), std::move(staging), &handle);
      token_out->typed_data()[0] = handle;
      return CompletedFuture(issued);
    }
    if (!attrs.split) {
      token_out->typed_data()[0] = token.typed_data()[0] + 1;
      return completion->Wait();
    }
    std::vector<const void*> written;
    std::apply(
        [&](const auto&... k) {
          auto add = [&](const auto& one) {
            if constexpr (WrittenByEngine<std::decay_t<decltype(one)>>::value) {
              written.push_back(one.written());
            }
          };
          (add(k), ...);
        },
        *kept);
    token_out->typed_data()[0] = IssueTicket(std::move(completion), std::move(written));
    return CompletedFuture(ffi::Error::Success());
  }
};

// Defines and registers (ffi/registrations.h) the CPU handler of target `target`: the blocking
// collective `impl` run on the engine (AsyncCollective), bound by BindCollective() and then
// `bind_data` (e.g. BindDenseData: the op's own attributes, data and results, as on the GPU).
// Use it inside namespace jaxcomm::collectives.
#define JAXCOMM_DEFINE_COLLECTIVE(target, impl, bind_data)                                \
  JAXCOMM_DEFINE_HANDLER(target, ::jaxcomm::collectives::AsyncCollective<&impl>::Handler, \
                         bind_data(::jaxcomm::collectives::BindCollective()))

// Binds, in order: Ctx<ThreadPool>, Ctx<DeviceOrdinal>, Arg coordinates (S32[axes]), Arg token
// (S32[]), Attr collective (CollectiveAttrs). Each handler then adds its own attributes, data
// arguments and results.
inline auto BindCollective() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()                // intra-op threads for local kernels
      .Ctx<ffi::DeviceOrdinal>()             // global device id (CPU): finds our world rank
      .Arg<ffi::Buffer<ffi::S32, 1>>()       // coordinates: lax.axis_index of each mesh axis
      .Arg<ffi::Buffer<ffi::S32, 0>>()       // token: orders collectives (jaxcomm/_ordering.py)
      .Attr<CollectiveAttrs>("collective");  // world and mesh layout
}

// What the collectives bind after their common operands and own attributes, shared by the CPU
// and GPU handlers so that one ffi_call lowers to either platform unchanged.

// x in; the sum and the token out (dense allreduce, flat or hierarchical).
template <typename Binding>
auto BindDenseData(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()     // x: this rank's data
      .template Ret<ffi::Buffer<ffi::F32>>()     // out: the group sum
      .template Ret<ffi::BufferR0<ffi::S32>>();  // token out
}

// x and residual in; the sum, the new residual and the token out (compressed allreduce).
template <typename Binding>
auto BindCompressedData(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()     // x: local gradient
      .template Arg<ffi::Buffer<ffi::F32>>()     // residual in
      .template Ret<ffi::Buffer<ffi::F32>>()     // summed (identical on all ranks)
      .template Ret<ffi::Buffer<ffi::F32>>()     // new residual
      .template Ret<ffi::BufferR0<ffi::S32>>();  // token out
}

// The sparse collectives (TopK-allgather, gTop-k): k, then the compressed data.
template <typename Binding>
auto BindSparseCollective(Binding binding) {
  return BindCompressedData(std::move(binding).template Attr<int64_t>("k"));  // set size
}

// The call site of op `name` made by `caller` (CPU: coordinates are in host memory).
inline CallSite MakeCallSite(const char* name, const Caller& caller) {
  return CallSite{name,
                  caller.attrs.world,
                  caller.device_id,
                  caller.attrs.world_devices,
                  caller.attrs.mesh_axis_sizes,
                  caller.attrs.reduce_axes,
                  caller.coordinates.typed_data(),
                  static_cast<int64_t>(caller.coordinates.element_count())};
}

// The argument rules of the sparse (top-k based) collectives, on CPU and GPU: x, residual and
// both results hold n elements, n <= 2**31 - 1 (the kernels' 31-bit indices), and 1 <= k <= n.
inline ffi::Error CheckSparseArguments(const char* name, int64_t k, size_t n, size_t residual,
                                       size_t summed, size_t new_residual) {
  if (residual != n || summed != n || new_residual != n) {
    return ffi::Error::InvalidArgument(std::string(name) +
                                       ": x, residual and results must have one size");
  }
  if (k < 1 || k > static_cast<int64_t>(n)) {
    return ffi::Error::InvalidArgument(std::string(name) + ": k must be in [1, x.size]");
  }
  return ffi_common::CheckElementCount(name, static_cast<int64_t>(n));
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
