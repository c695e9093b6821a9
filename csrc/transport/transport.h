// The transport interface: register memory, connect a peer from its serialized descriptor, post a
// batch of one-sided writes, poll, release (cancelling if still in flight), close. Backends are
// non-copyable and must be safe to call from several writer threads at once. Nothing here throws:
// every verb returns a Status ("in progress" is Code::kInProgress, not an error).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace p2pw {

// One write: `length` bytes from local memory at `local_addr` to the peer's `remote_addr`.
struct WriteDesc {
  uint64_t local_addr;
  uint64_t remote_addr;
  uint64_t length;
};

using RequestId = uint64_t;

class Transport {
 public:
  Transport() = default;
  virtual ~Transport() = default;
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  virtual std::string name() const = 0;
  // location: "cpu" or "cuda:N".
  virtual Status register_memory(uint64_t addr, uint64_t length, const std::string& location) = 0;
  virtual Status deregister_memory(uint64_t addr) = 0;
  // `engine` is the writer's id for the peer; `descriptor` is what the peer published.
  virtual Status connect(int engine, const std::string& descriptor) = 0;
  virtual Status disconnect(int engine) = 0;
  // Posts all writes as one batch; on success *request identifies it for poll/release.
  virtual Status post(int engine, const std::vector<WriteDesc>& writes, RequestId* request) = 0;
  // kInProgress while running, kOk when every write landed, an error otherwise.
  virtual Status poll(RequestId request) = 0;
  // Frees the request, cancelling it first if still in flight. kOk: the transport no longer reads
  // the request's local memory. kBusy: it could not cancel a write that may still read it (Mooncake
  // cannot cancel); call release again later until it answers kOk — the writer keeps the slot
  // until then (invariant 2).
  virtual Status release(RequestId request) = 0;
  virtual void close() = 0;
};

}  // namespace p2pw
