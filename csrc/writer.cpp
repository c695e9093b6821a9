#include "writer.h"

#include <algorithm>

namespace p2pw {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

PipelinedWriter::PipelinedWriter(Transport* transport, TransferBuffer* buffer, WriterOptions options)
    : transport_(transport), buffer_(buffer), options_(options) {
  slot_pending_.assign(buffer->num_slots(), 0);
  slot_acquired_.assign(buffer->num_slots(), false);
}

PipelinedWriter::~PipelinedWriter() { close(); }

Status PipelinedWriter::add_engine(int engine, const std::string& name, std::vector<Region> regions) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Status(Code::kClosed, "writer is closed");
  if (engines_.count(engine)) return Status(Code::kInvalidArgument, "engine " + std::to_string(engine) + " already added");
  if (regions.empty()) return Status(Code::kInvalidArgument, "engine '" + name + "' published no memory regions");
  std::sort(regions.begin(), regions.end(), [](const Region& a, const Region& b) { return a.addr < b.addr; });
  auto e = std::make_unique<Engine>();
  e->id = engine;
  e->name = name;
  e->regions = std::move(regions);
  e->report.engine = engine;
  e->report.name = name;
  Engine* raw = e.get();
  engines_[engine] = std::move(e);
  raw->thread = std::thread([this, raw] { run_engine(raw); });
  return Status::Ok();
}

Status PipelinedWriter::remove_engine(int engine) {
  std::unique_ptr<Engine> e;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = engines_.find(engine);
    if (it == engines_.end()) return Status(Code::kNotFound, "unknown engine " + std::to_string(engine));
    if (it->second->busy || !it->second->queue.empty())
      return Status(Code::kBusy, "engine '" + it->second->name + "' has writes in flight");
    it->second->stop = true;
    it->second->cv.notify_all();
    e = std::move(it->second);
    engines_.erase(it);
  }
  e->thread.join();
  return Status::Ok();
}

Status PipelinedWriter::acquire(int* slot, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  const int n = static_cast<int>(slot_pending_.size());
  int found = -1;
  auto free_slot = [&] {
    if (closed_) return true;
    // Round robin, so a pipeline alternates slots and the oldest writes get the most time.
    for (int k = 0; k < n; ++k) {
      int i = (next_slot_ + k) % n;
      if (!slot_acquired_[i] && slot_pending_[i] == 0) { found = i; return true; }
    }
    return false;
  };
  if (timeout_s < 0) {
    slot_cv_.wait(lk, free_slot);
  } else if (!slot_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), free_slot)) {
    return Status(Code::kTimeout, "no transfer slot came free within " + std::to_string(timeout_s) + " s");
  }
  if (closed_) return Status(Code::kClosed, "writer is closed");
  slot_acquired_[found] = true;
  next_slot_ = (found + 1) % n;
  *slot = found;
  return Status::Ok();
}

Status PipelinedWriter::release_slot(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  if (slot < 0 || slot >= static_cast<int>(slot_acquired_.size()))
    return Status(Code::kInvalidArgument, "slot " + std::to_string(slot) + " does not exist");
  if (!slot_acquired_[slot]) return Status(Code::kInvalidArgument, "slot " + std::to_string(slot) + " is not acquired");
  slot_acquired_[slot] = false;
  slot_cv_.notify_all();
  return Status::Ok();
}

Status PipelinedWriter::check_write(const Write& w) const {
  const uint64_t slot_bytes = buffer_->slot_bytes();
  if (w.length == 0) return Status(Code::kInvalidArgument, "a write of zero bytes");
  if (w.slot_offset >= slot_bytes || w.length > slot_bytes - w.slot_offset)
    return Status(Code::kInvalidArgument,
                  "write [" + std::to_string(w.slot_offset) + ", +" + std::to_string(w.length) +
                      ") runs past the slot end (" + std::to_string(slot_bytes) + " bytes)");
  auto it = engines_.find(w.engine);
  if (it == engines_.end()) return Status(Code::kNotFound, "write to unknown engine " + std::to_string(w.engine));
  const auto& regions = it->second->regions;
  auto r = std::upper_bound(regions.begin(), regions.end(), w.remote_addr,
                            [](uint64_t a, const Region& reg) { return a < reg.addr; });
  bool inside = r != regions.begin() && (--r, w.remote_addr - r->addr <= r->length &&
                                         w.length <= r->length - (w.remote_addr - r->addr));
  if (!inside)
    return Status(Code::kOutOfRegion, "write of " + std::to_string(w.length) + " bytes at 0x" +
                                          [&] { char b[32]; snprintf(b, sizeof b, "%llx", (unsigned long long)w.remote_addr); return std::string(b); }() +
                                          " lies outside every region engine '" + it->second->name + "' published");
  return Status::Ok();
}

Status PipelinedWriter::submit(int slot, const std::vector<Write>& writes) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Status(Code::kClosed, "writer is closed");
  if (slot < 0 || slot >= static_cast<int>(slot_acquired_.size()))
    return Status(Code::kInvalidArgument, "slot " + std::to_string(slot) + " does not exist");
  if (!slot_acquired_[slot]) return Status(Code::kInvalidArgument, "slot " + std::to_string(slot) + " was not acquired");
  for (const Write& w : writes) {
    Status s = check_write(w);
    if (!s.ok()) return s;  // nothing posted; the slot stays acquired for the caller to release
  }
  std::map<int, Batch> batches;
  const uint64_t base = buffer_->address() + static_cast<uint64_t>(slot) * buffer_->slot_bytes();
  for (const Write& w : writes) {
    Batch& b = batches[w.engine];
    b.slot = slot;
    b.writes.push_back(WriteDesc{base + w.slot_offset, w.remote_addr, w.length});
    b.bytes += w.length;
  }
  for (auto& [engine, b] : batches) {
    Engine* e = engines_[engine].get();
    slot_pending_[slot] += 1;
    e->queue.push_back(std::move(b));
    e->cv.notify_all();
  }
  slot_acquired_[slot] = false;
  slot_cv_.notify_all();
  return Status::Ok();
}

void PipelinedWriter::batch_returned(Engine* e, const Batch& b, const Status& s) {
  EngineReport& r = e->report;
  e->last_done = Clock::now();
  r.batches += 1;
  if (s.ok()) {
    r.bytes += b.bytes;
    r.writes += b.writes.size();
    if (r.state != "failed") r.state = "ok";
  } else if (r.state != "failed") {
    r.state = "failed";
    r.code = s.code();
    r.error = s.message().empty() ? code_name(s.code()) : s.message();
  }
  slot_pending_[b.slot] -= 1;
  slot_cv_.notify_all();
}

void PipelinedWriter::run_engine(Engine* e) {
  const size_t max_inflight = static_cast<size_t>(std::max(1, options_.max_inflight_batches));
  std::deque<InFlight> inflight;  // posted, oldest first; touched by this thread only
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (inflight.empty()) {
      e->busy = false;
      slot_cv_.notify_all();
      e->cv.wait(lk, [&] { return e->stop || !e->queue.empty(); });
      if (e->queue.empty() && e->stop) return;
    }
    e->busy = true;
    // Post while there is room: a failed (or closing) engine's batches are skipped, so its slots
    // come free at once and a lost engine costs at most one timeout.
    while (!e->queue.empty() && inflight.size() < max_inflight) {
      Batch b = std::move(e->queue.front());
      e->queue.pop_front();
      if (e->report.state == "failed" || e->stop) {
        e->report.skipped_batches += 1;
        slot_pending_[b.slot] -= 1;
        slot_cv_.notify_all();
        continue;
      }
      if (!e->started) { e->started = true; e->first_post = Clock::now(); }
      lk.unlock();
      // The deadline starts before post: some transports (NIXL over cma) copy inside post itself.
      const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(options_.transfer_timeout_s));
      RequestId req = 0;
      Status s = transport_->post(e->id, b.writes, &req);
      lk.lock();
      if (s.ok()) {
        inflight.push_back(InFlight{std::move(b), req, deadline});
      } else {
        batch_returned(e, b, s);
      }
    }
    if (inflight.empty()) continue;
    // Poll the oldest first, backing off while nothing changes (no busy waiting on 2 cores).
    lk.unlock();
    double sleep_s = options_.poll_min_sleep_s;
    std::vector<std::pair<size_t, Status>> returned;
    for (;;) {
      for (size_t i = 0; i < inflight.size(); ++i) {
        Status s = transport_->poll(inflight[i].request);
        if (s.in_progress() && Clock::now() >= inflight[i].deadline) {
          s = Status(Code::kTimeout, "a write of " + std::to_string(inflight[i].batch.bytes) +
                                         " bytes was still running after " +
                                         std::to_string(options_.transfer_timeout_s) +
                                         " s (transfer timeout); cancelled");
        }
        if (!s.in_progress()) {
          transport_->release(inflight[i].request);  // cancels a timed-out write before the slot is reused
          returned.emplace_back(i, s);
        }
      }
      if (!returned.empty()) break;
      std::this_thread::sleep_for(std::chrono::duration<double>(sleep_s));
      sleep_s = std::min(sleep_s * 2, options_.poll_max_sleep_s);
    }
    lk.lock();
    bool failed = false;
    for (auto it = returned.rbegin(); it != returned.rend(); ++it) {
      batch_returned(e, inflight[it->first].batch, it->second);
      failed |= !it->second.ok();
      inflight.erase(inflight.begin() + static_cast<long>(it->first));
    }
    if (failed) {
      // The engine failed: cancel what is still in flight rather than wait for its deadline.
      lk.unlock();
      for (auto& f : inflight) transport_->release(f.request);
      lk.lock();
      for (auto& f : inflight) {
        e->report.skipped_batches += 1;
        slot_pending_[f.batch.slot] -= 1;
      }
      inflight.clear();
      slot_cv_.notify_all();
    }
  }
}

Status PipelinedWriter::finish(std::vector<EngineReport>* report) {
  std::unique_lock<std::mutex> lk(mu_);
  // Every write has a deadline, so this wait is bounded by the transfer timeout per queued batch.
  slot_cv_.wait(lk, [&] {
    for (auto& [_, e] : engines_) if (e->busy || !e->queue.empty()) return false;
    return true;
  });
  report->clear();
  for (auto& [_, e] : engines_) {
    EngineReport r = e->report;
    if (e->started) r.seconds = seconds_between(e->first_post, e->last_done);
    r.gbps = r.seconds > 0 ? static_cast<double>(r.bytes) / r.seconds / 1e9 : 0.0;
    report->push_back(r);
    e->report = EngineReport();
    e->report.engine = e->id;
    e->report.name = e->name;
    e->started = false;
  }
  return Status::Ok();
}

int PipelinedWriter::pending_batches(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  if (slot < 0 || slot >= static_cast<int>(slot_pending_.size())) return -1;
  return slot_pending_[slot];
}

void PipelinedWriter::close() {
  std::map<int, std::unique_ptr<Engine>> engines;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    for (auto& [_, e] : engines_) { e->stop = true; e->cv.notify_all(); }
    engines.swap(engines_);
    slot_cv_.notify_all();
  }
  for (auto& [_, e] : engines) e->thread.join();
}

}  // namespace p2pw
