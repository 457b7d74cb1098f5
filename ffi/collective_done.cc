// jaxcomm_collective_done: the second half of a split collective (ffi/engine.h, Tickets).
//
// Operands: the start's ticket (its token result), then the start's data results, then any
// number of buffers that must stay alive or exist first (the start's data operands, which the
// engine still reads, and the `after` values the caller wants computed before the sum is
// awaited). Results: the start's data results again, aliased (input_output_aliases), so the
// done returns the buffers the engine wrote, once it has written them.
#include "ffi/collective_done.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/engine.h"
#include "xla/ffi/api/ffi.h"

namespace jaxcomm::collectives {
namespace {
constexpr char kDoneOp[] = "jaxcomm_collective_done";
}  // namespace

ffi::Error DoneResults(ffi::RemainingArgs args, ffi::RemainingRets rets,
                       std::vector<const void*>* results) {
  if (args.size() < rets.size()) {
    return ffi::Error::InvalidArgument(std::string(kDoneOp) +
                                       ": fewer operands than results (each result is an "
                                       "operand, aliased)");
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    auto ret = rets.get<ffi::AnyBuffer>(i);
    if (arg.has_error()) return arg.error();  // not a buffer: a bug in _call.py
    if (ret.has_error()) return ret.error();
    if ((*ret)->untyped_data() != arg->untyped_data()) {
      return ffi::Error::InvalidArgument(std::string(kDoneOp) + ": result " + std::to_string(i) +
                                         " must alias operand " + std::to_string(i + 1) +
                                         " (input_output_aliases)");
    }
    results->push_back(arg->untyped_data());
  }
  return ffi::Error::Success();
}

namespace {

ffi::Error Redeem(ffi::Buffer<ffi::S32, 0> ticket, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  std::shared_ptr<Completion>* completion) {
  std::vector<const void*> results;
  JAXCOMM_RETURN_IF_ERROR(DoneResults(args, rets, &results));
  return RedeemTicket(ticket.typed_data()[0], results, completion);
}

ffi::Future CollectiveDoneImpl(ffi::Buffer<ffi::S32, 0> ticket, ffi::RemainingArgs args,
                               ffi::RemainingRets rets) {
  std::shared_ptr<Completion> completion;
  const ffi::Error error = Redeem(ticket, args, rets, &completion);
  return error.success() ? completion->Wait() : CompletedFuture(error);
}

}  // namespace
}  // namespace jaxcomm::collectives

JAXCOMM_DEFINE_HANDLER("jaxcomm_collective_done", jaxcomm::collectives::CollectiveDoneImpl,
                       xla::ffi::Ffi::Bind()
                           .Arg<xla::ffi::BufferR0<xla::ffi::S32>>()  // ticket
                           .RemainingArgs()    // start's results, then kept operands
                           .RemainingRets());  // start's results (aliased)
