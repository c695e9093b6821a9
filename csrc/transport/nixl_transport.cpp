#include "transport/nixl_transport.h"

#include <cstdlib>
#include <cstring>

#include "checked_math.h"

namespace p2pw {

namespace api = nixl_capi;

namespace {

// "cpu" -> DRAM 0, "cuda:N" -> VRAM N.
bool parse_location(const std::string& location, int* mem, uint64_t* dev) {
  if (location.empty() || location == "cpu") {
    *mem = api::kDram;
    *dev = 0;
    return true;
  }
  if (location.rfind("cuda", 0) != 0) return false;
  *mem = api::kVram;
  *dev = 0;
  if (location.size() == 4) return true;
  if (location[4] != ':' || location.size() == 5) return false;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(location.c_str() + 5, &end, 10);
  if (*end != '\0') return false;
  *dev = n;
  return true;
}

// Adjacent writes (contiguous locally and remotely) become one descriptor.
std::vector<WriteDesc> coalesce(const std::vector<WriteDesc>& writes) {
  std::vector<WriteDesc> out;
  out.reserve(writes.size());
  for (const WriteDesc& w : writes) {
    if (!out.empty() && out.back().local_addr + out.back().length == w.local_addr &&
        out.back().remote_addr + out.back().length == w.remote_addr) {
      out.back().length += w.length;
    } else {
      out.push_back(w);
    }
  }
  return out;
}

std::string request_key(int engine, const std::vector<WriteDesc>& writes) {
  std::string key(sizeof(int) + writes.size() * sizeof(WriteDesc), '\0');
  std::memcpy(&key[0], &engine, sizeof(int));
  if (!writes.empty()) std::memcpy(&key[sizeof(int)], writes.data(), writes.size() * sizeof(WriteDesc));
  return key;
}

}  // namespace

NixlTransport::NixlTransport(const NixlOptions& options, const api::Api* a) : options_(options), api_(a) {}

Status NixlTransport::create(const NixlOptions& options, std::unique_ptr<NixlTransport>* out) {
  out->reset();
  const api::Api* a = nullptr;
  Status s = api::load(options.library, &a);
  if (!s.ok()) return s;
  std::unique_ptr<NixlTransport> t(new NixlTransport(options, a));  // the constructor is private
  s = t->start();
  if (!s.ok()) return s;
  *out = std::move(t);
  return Status::Ok();
}

Status NixlTransport::start() {
  api::AgentConfig cfg{};
  cfg.enable_prog_thread = true;
  cfg.enable_listen_thread = false;
  cfg.listen_port = 0;
  // Several writer threads call the agent at once (the Python agent relies on the GIL instead).
  cfg.thread_sync = api::kSyncStrict;
  cfg.num_workers = 0;
  cfg.pthr_delay_us = options_.progress_delay_us;
  cfg.lthr_delay_us = 100000;
  cfg.capture_telemetry = false;
  int r = api_->create_configured_agent(options_.agent_name.c_str(), &cfg, &agent_);
  if (r != api::kSuccess) {
    agent_ = nullptr;
    return Status(Code::kTransportError, "NIXL agent '" + options_.agent_name + "' failed to start: " + api::describe(r));
  }
  api::MemList mems = nullptr;
  api::Params params = nullptr;
  r = api_->get_plugin_params(agent_, options_.plugin.c_str(), &mems, &params);
  if (r != api::kSuccess)
    return Status(Code::kTransportError, "NIXL has no " + options_.plugin + " plugin here (" + api::describe(r) +
                                             "); set P2PW_NIXL_BACKEND");
  r = api_->create_backend(agent_, options_.plugin.c_str(), params, &backend_);
  api_->destroy_mem_list(mems);
  api_->destroy_params(params);
  if (r != api::kSuccess) {
    backend_ = nullptr;
    return Status(Code::kTransportError, "NIXL " + options_.plugin + " plugin failed to start: " + api::describe(r));
  }
  return Status::Ok();
}

NixlTransport::~NixlTransport() {
  close();
  if (backend_ != nullptr) api_->destroy_backend(backend_);
  if (agent_ != nullptr) api_->destroy_agent(agent_);
}

// -- memory ----------------------------------------------------------------------------------------

Status NixlTransport::register_memory(uint64_t addr, uint64_t length, const std::string& location) {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) return Status(Code::kClosed, "nixl transport is closed");
  if (!range_fits(addr, length))
    return Status(Code::kInvalidArgument, "memory region of " + std::to_string(length) +
                                              " bytes runs past the end of the address space");
  Registration reg{length, 0, 0, nullptr};
  if (!parse_location(location, &reg.mem, &reg.dev))
    return Status(Code::kInvalidArgument, "unknown memory location '" + location + "'; expected cpu or cuda:N");
  int r = api_->create_reg_dlist(reg.mem, &reg.dlist);
  if (r == api::kSuccess) r = api_->reg_dlist_add_desc(reg.dlist, addr, length, reg.dev, nullptr, 0);
  if (r == api::kSuccess) r = api_->register_mem(agent_, reg.dlist, nullptr);
  if (r != api::kSuccess) {
    if (reg.dlist != nullptr) api_->destroy_reg_dlist(reg.dlist);
    return Status(Code::kTransportError, "NIXL register_memory(0x" + [&] {
      char b[32];
      std::snprintf(b, sizeof b, "%llx", static_cast<unsigned long long>(addr));
      return std::string(b);
    }() + ", " + std::to_string(length) + ", " + location + ") failed: " + api::describe(r));
  }
  std::lock_guard<std::mutex> lk(mu_);
  registered_[addr] = reg;
  return Status::Ok();
}

Status NixlTransport::deregister_memory(uint64_t addr) {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) return Status(Code::kClosed, "nixl transport is closed");
  Registration reg;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = registered_.find(addr);
    if (it == registered_.end()) return Status(Code::kNotFound, "0x" + std::to_string(addr) + " is not registered with NIXL");
    reg = it->second;
    registered_.erase(it);
  }
  const int r = api_->deregister_mem(agent_, reg.dlist, nullptr);
  api_->destroy_reg_dlist(reg.dlist);
  if (r != api::kSuccess) return Status(Code::kTransportError, "NIXL deregister_memory failed: " + api::describe(r));
  return Status::Ok();
}

bool NixlTransport::local_memory(uint64_t addr, uint64_t length, int* mem, uint64_t* dev) const {
  auto it = registered_.upper_bound(addr);
  if (it == registered_.begin()) return false;
  --it;
  if (addr - it->first > it->second.length || length > it->second.length - (addr - it->first)) return false;
  *mem = it->second.mem;
  *dev = it->second.dev;
  return true;
}

// -- peers -----------------------------------------------------------------------------------------

Status NixlTransport::connect(int engine, const std::string&) {
  return Status(Code::kInvalidArgument, "the native nixl transport connects engine " + std::to_string(engine) +
                                            " from decoded agent metadata: call connect_peer (NativeNixlTransport.connect "
                                            "parses the published descriptor)");
}

Status NixlTransport::connect_peer(int engine, const std::string& agent_metadata, const std::string& location) {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) return Status(Code::kClosed, "nixl transport is closed");
  Peer peer{"", 0, 0};
  if (!parse_location(location, &peer.mem, &peer.dev))
    return Status(Code::kInvalidArgument, "engine " + std::to_string(engine) + " published memory location '" +
                                              location + "'; expected cpu or cuda:N");
  if (agent_metadata.empty())
    return Status(Code::kInvalidArgument, "engine " + std::to_string(engine) + " published no NIXL agent metadata");
  char* name = nullptr;
  const int r = api_->load_remote_md(agent_, agent_metadata.data(), agent_metadata.size(), &name);
  if (r != api::kSuccess || name == nullptr)
    return Status(Code::kTransportError, "NIXL could not load the agent metadata engine " + std::to_string(engine) +
                                             " published: " + api::describe(r) +
                                             " (a forged or truncated publication, or a peer of another NIXL version)");
  peer.agent = name;
  std::free(name);  // strdup'ed by the C API
  drop_kept(engine, false);  // requests kept for an earlier connection target its old agent
  std::lock_guard<std::mutex> lk(mu_);
  peers_[engine] = peer;
  return Status::Ok();
}

Status NixlTransport::disconnect(int engine) {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) return Status(Code::kClosed, "nixl transport is closed");
  std::string agent;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(engine);
    if (it != peers_.end()) {
      agent = it->second.agent;
      peers_.erase(it);
      for (auto& [e, p] : peers_)
        if (p.agent == agent) agent.clear();  // still used by another engine
    }
  }
  drop_kept(engine, false);
  if (!agent.empty()) api_->invalidate_remote_md(agent_, agent.c_str());  // a dead peer may be half-removed
  return Status::Ok();
}

// -- writes ----------------------------------------------------------------------------------------

Status NixlTransport::new_request(const Peer& peer, const std::vector<WriteDesc>& writes, api::XferReq* out) {
  int mem = 0;
  uint64_t dev = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!local_memory(writes[0].local_addr, writes[0].length, &mem, &dev))
      return Status(Code::kInvalidArgument, "local memory of a write is not registered with NIXL");
  }
  api::XferDlist src = nullptr, dst = nullptr;
  int r = api_->create_xfer_dlist(mem, &src);
  if (r == api::kSuccess) r = api_->create_xfer_dlist(peer.mem, &dst);
  for (size_t i = 0; r == api::kSuccess && i < writes.size(); ++i) {
    r = api_->xfer_dlist_add_desc(src, writes[i].local_addr, writes[i].length, dev);
    if (r == api::kSuccess) r = api_->xfer_dlist_add_desc(dst, writes[i].remote_addr, writes[i].length, peer.dev);
  }
  if (r == api::kSuccess) r = api_->create_xfer_req(agent_, api::kWrite, src, dst, peer.agent.c_str(), out, nullptr);
  if (src != nullptr) api_->destroy_xfer_dlist(src);
  if (dst != nullptr) api_->destroy_xfer_dlist(dst);
  if (r != api::kSuccess) {
    *out = nullptr;
    return Status(Code::kTransportError, "NIXL could not create a write to " + peer.agent + ": " + api::describe(r) +
                                             " (remote addresses outside the memory the engine registered?)");
  }
  std::lock_guard<std::mutex> lk(mu_);
  ++made_;
  return Status::Ok();
}

Status NixlTransport::post(int engine, const std::vector<WriteDesc>& writes, RequestId* request) {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) return Status(Code::kClosed, "nixl transport is closed");
  if (writes.empty()) return Status(Code::kInvalidArgument, "an empty batch of writes");
  Peer peer;
  RequestId rid;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = peers_.find(engine);
    if (it == peers_.end()) return Status(Code::kNotFound, "engine " + std::to_string(engine) + " is not connected");
    peer = it->second;
    rid = next_++;
  }
  reap_abandoned();
  const std::vector<WriteDesc> merged = coalesce(writes);
  std::string key = request_key(engine, merged);
  api::XferReq handle = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto k = kept_index_.find(key);
    if (k != kept_index_.end()) {  // taken: never posted twice at once
      handle = k->second->second;
      kept_.erase(k->second);
      kept_index_.erase(k);
      ++reposted_;
    }
  }
  if (handle == nullptr) {
    Status s = new_request(peer, merged, &handle);
    if (!s.ok()) return s;
  }
  const int r = api_->post_xfer_req(agent_, handle, nullptr);
  if (r != api::kSuccess && r != api::kInProgress) {
    release_or_abandon(handle);
    return Status(Code::kTransportError, "NIXL transfer to " + peer.agent + " failed to post: " + api::describe(r));
  }
  Request req{engine, handle, std::move(key), r == api::kSuccess, Status::Ok()};
  std::lock_guard<std::mutex> lk(mu_);
  requests_.emplace(rid, std::move(req));
  *request = rid;
  return Status::Ok();
}

Status NixlTransport::poll(RequestId request) {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) return Status(Code::kClosed, "nixl transport is closed");
  api::XferReq handle;
  int engine;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) return Status(Code::kNotFound, "unknown NIXL request " + std::to_string(request));
    if (!it->second.error.ok()) return it->second.error;
    if (it->second.done) return Status::Ok();
    handle = it->second.handle;
    engine = it->second.engine;
  }
  const int r = api_->get_xfer_status(agent_, handle);
  if (r == api::kInProgress) return Status::InProgress();
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return Status(Code::kNotFound, "unknown NIXL request " + std::to_string(request));
  if (r == api::kSuccess) {
    it->second.done = true;
    return Status::Ok();
  }
  it->second.error = Status(Code::kTransportError, "NIXL write to engine " + std::to_string(engine) +
                                                       " failed: " + api::describe(r) + " (is the engine's agent gone?)");
  return it->second.error;
}

Status NixlTransport::release(RequestId request) {
  std::shared_lock<std::shared_mutex> life(life_);
  if (closed_) return Status(Code::kClosed, "nixl transport is closed");
  Request req{};
  api::XferReq evicted = nullptr;
  bool keep = false;
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto it = requests_.find(request);
    if (it == requests_.end()) {  // asked again after kBusy
      auto d = draining_.find(request);
      if (d == draining_.end()) return Status(Code::kNotFound, "unknown NIXL request " + std::to_string(request));
      api::XferReq h = d->second;
      draining_.erase(d);
      lk.unlock();
      if (release_handle(h)) return Status::Ok();
      lk.lock();
      draining_[request] = h;
      return Status(Code::kBusy, "NIXL refuses to release a write that may still read its slot");
    }
    req = std::move(it->second);
    requests_.erase(it);
    keep = req.done && req.error.ok() && peers_.count(req.engine) && !kept_index_.count(req.key);
    if (keep) {
      kept_.emplace_front(req.key, req.handle);
      kept_index_[req.key] = kept_.begin();
      if (kept_.size() > kMaxKeptRequests) {
        evicted = kept_.back().second;
        kept_index_.erase(kept_.back().first);
        kept_.pop_back();
      }
    }
  }
  if (evicted != nullptr) release_or_abandon(evicted);
  if (keep) return Status::Ok();
  if (release_handle(req.handle)) return Status::Ok();  // cancels a write still in flight
  std::lock_guard<std::mutex> lk(mu_);
  draining_[request] = req.handle;
  return Status(Code::kBusy, "NIXL refuses to release a write that may still read its slot");
}

bool NixlTransport::release_handle(api::XferReq handle) {
  if (api_->release_xfer_req(agent_, handle) != api::kSuccess) return false;
  api_->destroy_xfer_req(handle);
  return true;
}

void NixlTransport::release_or_abandon(api::XferReq handle) {
  if (release_handle(handle)) return;
  std::lock_guard<std::mutex> lk(mu_);
  abandoned_.push_back(handle);  // refused while busy: retried on the next post
}

void NixlTransport::reap_abandoned() {
  std::vector<api::XferReq> work;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (abandoned_.empty()) return;
    work.swap(abandoned_);
  }
  for (api::XferReq h : work) release_or_abandon(h);
}

void NixlTransport::drop_kept(int engine, bool every_engine) {
  std::vector<api::XferReq> handles;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = kept_.begin(); it != kept_.end();) {
      int e;
      std::memcpy(&e, it->first.data(), sizeof(int));
      if (every_engine || e == engine) {
        handles.push_back(it->second);
        kept_index_.erase(it->first);
        it = kept_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (api::XferReq h : handles) release_or_abandon(h);
}

NixlStats NixlTransport::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  NixlStats s;
  s.requests_made = made_;
  s.requests_reposted = reposted_;
  s.kept = kept_.size();
  s.draining = draining_.size() + abandoned_.size();
  return s;
}

void NixlTransport::close() {
  std::unique_lock<std::shared_mutex> life(life_);
  if (closed_ || agent_ == nullptr) {
    closed_ = true;
    return;
  }
  closed_ = true;
  std::vector<api::XferReq> handles;
  std::vector<std::string> agents;
  std::map<uint64_t, Registration> regs;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& [id, r] : requests_) handles.push_back(r.handle);
    for (auto& [id, h] : draining_) handles.push_back(h);
    for (auto& [k, h] : kept_) handles.push_back(h);
    handles.insert(handles.end(), abandoned_.begin(), abandoned_.end());
    requests_.clear();
    draining_.clear();
    kept_.clear();
    kept_index_.clear();
    abandoned_.clear();
    for (auto& [e, p] : peers_) agents.push_back(p.agent);
    peers_.clear();
    regs.swap(registered_);
  }
  // Best effort: the agent is destroyed with the transport, which frees whatever NIXL still holds.
  for (api::XferReq h : handles) release_handle(h);
  for (const std::string& a : agents) api_->invalidate_remote_md(agent_, a.c_str());
  for (auto& [addr, reg] : regs) {
    api_->deregister_mem(agent_, reg.dlist, nullptr);
    api_->destroy_reg_dlist(reg.dlist);
  }
}

}  // namespace p2pw
