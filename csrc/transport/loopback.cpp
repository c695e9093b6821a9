#include "transport/loopback.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "checked_math.h"

namespace p2pw {

namespace {
using Clock = std::chrono::steady_clock;
constexpr uint64_t kChunk = 4ull << 20;  // copy granularity: lets release() and link pacing act mid-batch
}  // namespace

struct LoopbackTransport::Request {
  std::vector<WriteDesc> writes;
  std::atomic<int> code{static_cast<int>(Code::kInProgress)};
  std::atomic<bool> cancelled{false};
  bool copying = false;  // a chunk is being copied from local memory (mu_): release waits it out
  std::string error;  // written by the worker before code leaves kInProgress
};

struct LoopbackTransport::Peer {
  int engine = 0;
  LoopbackFault fault;
  std::deque<std::shared_ptr<Request>> queue;
  std::condition_variable cv;
  std::thread thread;
  bool stop = false;
  std::atomic<uint64_t> bytes{0};
};

LoopbackTransport::LoopbackTransport() = default;
LoopbackTransport::~LoopbackTransport() { close(); }

Status LoopbackTransport::register_memory(uint64_t addr, uint64_t length, const std::string&) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Status(Code::kClosed, "loopback transport is closed");
  if (addr == 0 || length == 0) return Status(Code::kInvalidArgument, "empty memory region");
  if (!range_fits(addr, length)) return Status(Code::kInvalidArgument, "memory region runs past the end of the address space");
  registered_[addr] = length;
  return Status::Ok();
}

Status LoopbackTransport::deregister_memory(uint64_t addr) {
  std::lock_guard<std::mutex> lk(mu_);
  return registered_.erase(addr) ? Status::Ok()
                                 : Status(Code::kNotFound, "address was not registered");
}

Status LoopbackTransport::connect(int engine, const std::string&) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Status(Code::kClosed, "loopback transport is closed");
  auto& slot = peers_[engine];
  if (slot) {
    slot->fault.disconnected = false;  // a reconnect heals a disconnect
    return Status::Ok();
  }
  slot = std::make_unique<Peer>();
  slot->engine = engine;
  Peer* p = slot.get();
  p->thread = std::thread([this, p] { run_peer(p); });
  return Status::Ok();
}

Status LoopbackTransport::disconnect(int engine) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(engine);
  if (it == peers_.end()) return Status(Code::kNotFound, "engine " + std::to_string(engine) + " not connected");
  it->second->fault.disconnected = true;
  it->second->cv.notify_all();
  return Status::Ok();
}

Status LoopbackTransport::set_fault(int engine, const LoopbackFault& fault) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(engine);
  if (it == peers_.end()) return Status(Code::kNotFound, "engine " + std::to_string(engine) + " not connected");
  it->second->fault = fault;
  it->second->cv.notify_all();
  return Status::Ok();
}

uint64_t LoopbackTransport::bytes_copied(int engine) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = peers_.find(engine);
  return it == peers_.end() ? 0 : it->second->bytes.load();
}

Status LoopbackTransport::post(int engine, const std::vector<WriteDesc>& writes, RequestId* request) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Status(Code::kClosed, "loopback transport is closed");
  auto it = peers_.find(engine);
  if (it == peers_.end()) return Status(Code::kNotFound, "engine " + std::to_string(engine) + " not connected");
  if (it->second->fault.disconnected)
    return Status(Code::kRemoteDisconnected, "engine " + std::to_string(engine) + " disconnected");
  for (const auto& w : writes) {
    auto r = registered_.upper_bound(w.local_addr);
    bool inside = r != registered_.begin() && (--r, w.local_addr - r->first <= r->second &&
                                               w.length <= r->second - (w.local_addr - r->first));
    if (!inside) return Status(Code::kInvalidArgument, "local memory of a write is not registered");
  }
  auto req = std::make_shared<Request>();
  req->writes = writes;
  RequestId id = next_request_++;
  requests_[id] = req;
  it->second->queue.push_back(req);
  it->second->cv.notify_all();
  *request = id;
  return Status::Ok();
}

Status LoopbackTransport::poll(RequestId request) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return Status(Code::kNotFound, "unknown request");
  Code c = static_cast<Code>(it->second->code.load());
  if (c == Code::kInProgress || c == Code::kOk) return Status(c, "");
  return Status(c, it->second->error);
}

Status LoopbackTransport::release(RequestId request) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = requests_.find(request);
  if (it == requests_.end()) return Status(Code::kNotFound, "unknown request");
  std::shared_ptr<Request> req = it->second;
  req->cancelled = true;
  requests_.erase(it);
  for (auto& [_, p] : peers_) p->cv.notify_all();
  // A cancelled write stops between chunks; once release returns it reads no local memory.
  copy_cv_.wait(lk, [&] { return !req->copying; });
  return Status::Ok();
}

void LoopbackTransport::close() {
  std::map<int, std::unique_ptr<Peer>> peers;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    for (auto& [_, p] : peers_) {
      p->stop = true;
      for (auto& r : p->queue) r->cancelled = true;
      p->cv.notify_all();
    }
    peers.swap(peers_);
  }
  for (auto& [_, p] : peers) p->thread.join();
  std::lock_guard<std::mutex> lk(mu_);
  requests_.clear();
}

void LoopbackTransport::run_peer(Peer* p) {
  std::unique_lock<std::mutex> lk(mu_);
  auto fail = [](Request& r, Code c, std::string why) {
    r.error = std::move(why);
    r.code = static_cast<int>(c);
  };
  for (;;) {
    p->cv.wait(lk, [&] { return p->stop || !p->queue.empty(); });
    if (p->stop) return;
    std::shared_ptr<Request> req = p->queue.front();
    p->queue.pop_front();
    const std::string who = "engine " + std::to_string(p->engine);
    const Clock::time_point start = Clock::now();
    if (p->fault.delay_s > 0) {
      p->cv.wait_until(lk, start + std::chrono::duration<double>(p->fault.delay_s),
                       [&] { return p->stop || req->cancelled.load(); });
    }
    if (p->fault.hang) {
      p->cv.wait(lk, [&] { return p->stop || req->cancelled.load() || !p->fault.hang; });
    }
    // Copy in chunks without the lock; pace each chunk to the emulated link.
    double link = p->fault.link_gbps;
    const Clock::time_point link_start = Clock::now();
    uint64_t sent = 0;
    bool ok = true;
    for (const WriteDesc& w : req->writes) {
      for (uint64_t off = 0; off < w.length && ok; off += kChunk) {
        if (p->stop || req->cancelled) { fail(*req, Code::kTransportError, "cancelled"); ok = false; break; }
        if (p->fault.disconnected) {
          fail(*req, Code::kRemoteDisconnected, who + " disconnected during the write");
          ok = false;
          break;
        }
        uint64_t n = std::min(kChunk, w.length - off);
        if (p->fault.fail_after_bytes >= 0 &&
            p->bytes.load() + n > static_cast<uint64_t>(p->fault.fail_after_bytes)) {
          fail(*req, Code::kTransportError,
               who + ": injected failure after " + std::to_string(p->fault.fail_after_bytes) + " bytes");
          ok = false;
          break;
        }
        req->copying = true;
        lk.unlock();
        std::memcpy(reinterpret_cast<void*>(w.remote_addr + off), reinterpret_cast<void*>(w.local_addr + off), n);
        sent += n;
        p->bytes += n;
        lk.lock();
        req->copying = false;
        copy_cv_.notify_all();
        if (link > 0) {
          lk.unlock();
          auto due = link_start + std::chrono::duration<double>(static_cast<double>(sent) / (link * 1e9));
          std::this_thread::sleep_until(due);
          lk.lock();
        }
      }
      if (!ok) break;
    }
    if (ok) req->code = static_cast<int>(Code::kOk);
  }
}

}  // namespace p2pw
