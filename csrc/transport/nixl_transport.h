// NIXL driven natively through its C API (nixl_capi.h): the writer's per-engine threads post and
// poll NIXL transfer requests without Python, so the GIL stays with the trainer's loaders.
//
// What it keeps from the Python backend (python/p2pweights/transport/nixl.py): one posted batch is
// one NIXL WRITE request over the coalesced writes; a request that completed is kept, keyed by its
// engine and exact writes, and re-posted by the next identical batch (least recently used go past
// kMaxKeptRequests); kept requests of an engine are released when it disconnects or reconnects;
// release cancels a write in flight, and a handle NIXL refuses to release answers kBusy (the writer
// keeps the slot and asks again). The progress thread sleeps `progress_delay_us` between rounds.
//
// connect() takes the peer's agent metadata already decoded (connect_peer): the descriptor's JSON
// is parsed, and checked for the right transport, on the Python side (NativeNixlTransport).
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/nixl_capi.h"
#include "transport/transport.h"

namespace p2pw {

struct NixlOptions {
  std::string library;           // path of libnixl_capi.so
  std::string agent_name;
  std::string plugin = "UCX";
  uint64_t progress_delay_us = 1000;
};

struct NixlStats {
  uint64_t requests_made = 0;     // NIXL transfer requests created
  uint64_t requests_reposted = 0; // posts that re-used a kept request
  uint64_t kept = 0;              // completed requests kept now
  uint64_t draining = 0;          // handles NIXL refused to release, retried later
};

class NixlTransport final : public Transport {
 public:
  static constexpr size_t kMaxKeptRequests = 1024;

  // Loads the C API, creates the agent and its plugin. *out is null on error.
  static Status create(const NixlOptions& options, std::unique_ptr<NixlTransport>* out);
  ~NixlTransport() override;

  std::string name() const override { return "nixl"; }
  Status register_memory(uint64_t addr, uint64_t length, const std::string& location) override;
  Status deregister_memory(uint64_t addr) override;
  // Refuses: the descriptor is JSON; use connect_peer with its decoded metadata.
  Status connect(int engine, const std::string& descriptor) override;
  Status connect_peer(int engine, const std::string& agent_metadata, const std::string& location);
  Status disconnect(int engine) override;
  Status post(int engine, const std::vector<WriteDesc>& writes, RequestId* request) override;
  Status poll(RequestId request) override;
  Status release(RequestId request) override;
  void close() override;

  const std::string& agent_name() const { return options_.agent_name; }
  const std::string& plugin() const { return options_.plugin; }
  const std::string& library() const { return api_->library; }
  NixlStats stats() const;

 private:
  struct Peer {
    std::string agent;
    int mem;
    uint64_t dev;
  };
  struct Registration {
    uint64_t length;
    int mem;
    uint64_t dev;
    nixl_capi::RegDlist dlist;
  };
  struct Request {
    int engine;
    nixl_capi::XferReq handle;
    std::string key;
    bool done = false;
    Status error;
  };

  NixlTransport(const NixlOptions& options, const nixl_capi::Api* api);
  Status start();
  // Releases a handle (cancelling it if in flight) and frees it; false if NIXL refused.
  bool release_handle(nixl_capi::XferReq handle);
  void release_or_abandon(nixl_capi::XferReq handle);
  void reap_abandoned();
  void drop_kept(int engine, bool every_engine);
  Status new_request(const Peer& peer, const std::vector<WriteDesc>& writes, nixl_capi::XferReq* out);
  bool local_memory(uint64_t addr, uint64_t length, int* mem, uint64_t* dev) const;

  NixlOptions options_;
  const nixl_capi::Api* api_;
  nixl_capi::Agent agent_ = nullptr;
  nixl_capi::BackendHandle backend_ = nullptr;

  // Held shared by every verb, exclusively by close(): NIXL is never called after the agent is gone.
  mutable std::shared_mutex life_;
  bool closed_ = false;

  mutable std::mutex mu_;  // guards everything below; never held across a NIXL call
  std::map<int, Peer> peers_;
  std::map<uint64_t, Registration> registered_;
  std::unordered_map<RequestId, Request> requests_;
  std::unordered_map<RequestId, nixl_capi::XferReq> draining_;  // refused: the request keeps its slot
  std::vector<nixl_capi::XferReq> abandoned_;                   // refused, nobody waits: retried later
  std::list<std::pair<std::string, nixl_capi::XferReq>> kept_;  // most recently used first
  std::unordered_map<std::string, std::list<std::pair<std::string, nixl_capi::XferReq>>::iterator> kept_index_;
  RequestId next_ = 1;
  uint64_t made_ = 0, reposted_ = 0;
};

}  // namespace p2pw
