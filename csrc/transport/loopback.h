// In-process loopback transport for tests and the writer benchmark. Remote addresses are addresses
// in this process. Per engine: a worker thread that copies each batch in chunks, optionally at an
// emulated link rate (a write occupies the link for bytes / bandwidth), with fault injection:
// a start delay, failure after N bytes, a hang (never completes until released), a disconnect.
// Not a stand-in for a real transport in end-to-end tests: those use Mooncake and NIXL.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "transport/transport.h"

namespace p2pw {

struct LoopbackFault {
  double delay_s = 0.0;              // each batch waits this long before its first byte
  int64_t fail_after_bytes = -1;     // fail once this many bytes went to the engine (-1: never)
  bool hang = false;                 // batches never complete (until released)
  bool disconnected = false;         // posts and in-flight batches fail as a lost peer
  double link_gbps = 0.0;            // emulated link rate in GB/s (0: as fast as memcpy)
};

class LoopbackTransport final : public Transport {
 public:
  LoopbackTransport();
  ~LoopbackTransport() override;

  std::string name() const override { return "loopback"; }
  Status register_memory(uint64_t addr, uint64_t length, const std::string& location) override;
  Status deregister_memory(uint64_t addr) override;
  Status connect(int engine, const std::string& descriptor) override;
  Status disconnect(int engine) override;
  Status post(int engine, const std::vector<WriteDesc>& writes, RequestId* request) override;
  Status poll(RequestId request) override;
  Status release(RequestId request) override;
  void close() override;

  Status set_fault(int engine, const LoopbackFault& fault);
  uint64_t bytes_copied(int engine);

 private:
  struct Request;
  struct Peer;
  void run_peer(Peer* peer);

  std::mutex mu_;
  std::condition_variable copy_cv_;
  std::map<int, std::unique_ptr<Peer>> peers_;
  std::map<RequestId, std::shared_ptr<Request>> requests_;
  std::map<uint64_t, uint64_t> registered_;  // addr -> length
  RequestId next_request_ = 1;
  bool closed_ = false;
};

}  // namespace p2pw
