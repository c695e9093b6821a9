#include "writer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdio>

#include "checked_math.h"

namespace p2pw {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

const char* engine_state_name(EngineState s) {
  switch (s) {
    case EngineState::kIdle: return "idle";
    case EngineState::kOk: return "ok";
    case EngineState::kFailed: return "failed";
  }
  return "unknown";
}

PipelinedWriter::PipelinedWriter(Transport* transport, TransferBuffer* buffer, WriterOptions options)
    : transport_(transport), buffer_(buffer), options_(options) {
  slot_pending_.assign(buffer->num_slots(), 0);
  slot_acquired_.assign(buffer->num_slots(), false);
  drain_thread_ = std::thread([this] { run_drain(); });
}

PipelinedWriter::~PipelinedWriter() { close(); }

template <typename F>
Status PipelinedWriter::guarded(const char* verb, F&& f) {
  try {
    return f();
  } catch (const std::exception& x) {
    return Status(Code::kTransportError, transport_->name() + " " + verb + " threw: " + x.what());
  } catch (...) {
    return Status(Code::kTransportError, transport_->name() + " " + verb + " threw an unknown exception");
  }
}

Status PipelinedWriter::add_engine(int engine, const std::string& name, std::vector<Region> regions) {
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) return Status(Code::kClosed, "writer is closed");
  if (engines_.count(engine)) return Status(Code::kInvalidArgument, "engine " + std::to_string(engine) + " already added");
  if (regions.empty()) return Status(Code::kInvalidArgument, "engine '" + name + "' published no memory regions");
  for (const Region& r : regions) {
    if (!range_fits(r.addr, r.length)) {
      char b[32];
      snprintf(b, sizeof b, "%llx", static_cast<unsigned long long>(r.addr));
      return Status(Code::kInvalidArgument, "engine '" + name + "' published a region of " + std::to_string(r.length) +
                                                " bytes at 0x" + b + " that runs past the end of the address space");
    }
  }
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

Status PipelinedWriter::fence(int engine, double seconds) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = engines_.find(engine);
  if (it == engines_.end()) return Status(Code::kNotFound, "engine " + std::to_string(engine) + " is not attached");
  if (std::isnan(seconds)) return Status(Code::kInvalidArgument, "a fence of NaN seconds");
  if (seconds == std::numeric_limits<double>::infinity() || seconds > 1e9) {
    it->second->post_until = Clock::time_point::max();
  } else {
    it->second->post_until = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                std::chrono::duration<double>(std::max(seconds, -1.0)));
  }
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
  const auto start = Clock::now();
  const auto give_up = timeout_s < 0 ? Clock::time_point::max()
                                     : start + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(timeout_s));
  const auto stuck_after = start + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(options_.transfer_timeout_s));
  while (!free_slot()) {
    const auto now = Clock::now();
    if (now >= give_up)
      return Status(Code::kTimeout, "no transfer slot came free within " + std::to_string(timeout_s) + " s");
    if (now >= stuck_after) {
      // Every slot that is not the caller's is held only by writes the transport could not cancel?
      std::map<int, int> draining_per_slot;
      std::string engines;
      for (const Draining& d : draining_) {
        draining_per_slot[d.slot] += 1;
        if (engines.find("'" + d.engine + "'") == std::string::npos) engines += (engines.empty() ? "'" : ", '") + d.engine + "'";
      }
      bool all_draining = true;
      for (int i = 0; i < n; ++i)
        if (!slot_acquired_[i] && slot_pending_[i] != draining_per_slot[i]) all_draining = false;
      if (all_draining && !draining_.empty())
        return Status(Code::kBusy, "every transfer slot is still read by writes to engine " + engines +
                                       " that were released at the transfer timeout but that the transport "
                                       "cannot cancel; the slots come free when those writes end (resume or "
                                       "restart that engine)");
    }
    // Wake at the caller's limit or, past the transfer timeout, now and then to re-check the above.
    auto wake = std::min(give_up, now >= stuck_after ? now + std::chrono::milliseconds(100) : stuck_after);
    slot_cv_.wait_until(lk, wake);
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
  // Only from a slot the caller holds: one never acquired, released, or already submitted may be
  // refilled by another fill or still be read by its writes.
  if (!slot_acquired_[slot])
    return Status(Code::kInvalidArgument, "slot " + std::to_string(slot) + " was not acquired (acquire() it first; " +
                                              "a released or already submitted slot is not the caller's)");
  for (const Write& w : writes) {
    Status s = check_write(w);
    if (!s.ok()) return s;  // nothing posted; the slot stays acquired for the caller to release
  }
  std::map<int, Batch> batches;
  const uint64_t base = buffer_->address() + static_cast<uint64_t>(slot) * buffer_->slot_bytes();
  for (const Write& w : writes) {
    Batch& b = batches[w.engine];
    b.slot = slot;
    b.update = update_;
    b.writes.push_back(WriteDesc{base + w.slot_offset, w.remote_addr, w.length});
    b.bytes += w.length;
  }
  // Each batch holds the buffer's memory until it returns (a close meanwhile is deferred).
  if (!batches.empty() && !buffer_->begin_use(static_cast<int>(batches.size())))
    return Status(Code::kClosed, "the transfer buffer is closed");
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

void PipelinedWriter::record(Engine* e, const Batch& b, const Status& s) {
  if (b.update != update_) return;  // finish() already reported that update (a post that blocked)
  EngineReport& r = e->report;
  e->last_done = Clock::now();
  r.batches += 1;
  if (s.ok()) {
    r.bytes += b.bytes;
    r.writes += b.writes.size();
    if (r.state != EngineState::kFailed) r.state = EngineState::kOk;
  } else if (r.state != EngineState::kFailed) {
    r.state = EngineState::kFailed;
    r.code = s.code();
    r.error = s.message().empty() ? code_name(s.code()) : s.message();
  }
}

void PipelinedWriter::slot_read_ended(int slot) {
  slot_pending_[slot] -= 1;
  buffer_->end_use(1);
  slot_cv_.notify_all();
}

void PipelinedWriter::skip(Engine* e, const Batch& b) {
  if (b.update == update_) e->report.skipped_batches += 1;
  slot_read_ended(b.slot);
}

void PipelinedWriter::released(Engine* e, const InFlight& f, const Status& release_status) {
  if (release_status.code() == Code::kBusy) {
    // The transport could not cancel it (Mooncake): the slot stays read until the drain thread
    // sees the write end (invariant 2).
    draining_.push_back(Draining{f.request, f.batch.slot, e->name});
    drain_cv_.notify_all();
  } else {
    slot_read_ended(f.batch.slot);
  }
}

void PipelinedWriter::run_engine(Engine* e) {
  ThreadState st;
  for (;;) {
    std::string what;
    try {
      engine_loop(e, st);
      return;
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
      what = "an unknown exception";
    }
    engine_threw(e, st, what);
  }
}

void PipelinedWriter::engine_threw(Engine* e, ThreadState& st, const std::string& what) {
  // Whatever escaped (e.g. std::bad_alloc) fails this engine; its writes are cancelled and their
  // slots accounted for exactly as after a failed write, then the thread carries on.
  std::vector<Status> rs;
  for (auto& f : st.inflight) rs.push_back(guarded("release", [&] { return transport_->release(f.request); }));
  std::lock_guard<std::mutex> lk(mu_);
  e->in_post = false;
  Status failed(Code::kTransportError, "the write thread of engine '" + e->name + "' caught " + what);
  for (size_t i = 0; i < st.inflight.size(); ++i) {
    record(e, st.inflight[i].batch, failed);
    released(e, st.inflight[i], rs[i]);
  }
  for (auto& b : st.posting) {
    record(e, b, failed);
    slot_read_ended(b.slot);
  }
  if (st.inflight.empty() && st.posting.empty() && e->report.state != EngineState::kFailed) {
    e->report.state = EngineState::kFailed;
    e->report.code = failed.code();
    e->report.error = failed.message();
  }
  st.inflight.clear();
  st.posting.clear();
  slot_cv_.notify_all();
}

void PipelinedWriter::engine_loop(Engine* e, ThreadState& st) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (st.inflight.empty()) {
      e->busy = false;
      slot_cv_.notify_all();
      e->cv.wait(lk, [&] { return e->stop || !e->queue.empty(); });
      if (e->queue.empty() && e->stop) return;
    }
    e->busy = true;
    post_ready(e, st, lk);
    if (!st.inflight.empty()) poll_inflight(e, st, lk);
  }
}

void PipelinedWriter::post_ready(Engine* e, ThreadState& st, std::unique_lock<std::mutex>& lk) {
  const size_t max_inflight = static_cast<size_t>(std::max(1, options_.max_inflight_batches));
  // Post while there is room: a failed (or closing) engine's batches are skipped, so its slots
  // come free at once and a lost engine costs at most one timeout.
  while (!e->queue.empty() && st.inflight.size() < max_inflight) {
    st.posting.push_back(std::move(e->queue.front()));
    e->queue.pop_front();
    Batch& b = st.posting.back();
    if (e->report.state == EngineState::kFailed || e->stop) {
      skip(e, b);
      st.posting.clear();
      continue;
    }
    if (!e->started) { e->started = true; e->first_post = Clock::now(); }
    e->in_post = true;
    e->post_started = Clock::now();
    slot_cv_.notify_all();  // finish() times a post that does not return
    lk.unlock();
    // The deadline starts before post: some transports (NIXL over cma) copy inside post itself.
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(options_.transfer_timeout_s));
    RequestId req = 0;
    const auto until = e->post_until;  // read under the lock; fence() writes it under the lock
    Status s = guarded("post", [&] {
      if (Clock::now() >= until)  // checked at the last moment before the transport sees the batch
        return Status(Code::kFenced, "engine " + e->name + ": not posted: the session's lease ended before this write "
                                     "(the sender was stopped or cut off longer than its lease; another controller may own the engine now)");
      return transport_->post(e->id, b.writes, &req);
    });
    lk.lock();
    e->in_post = false;
    if (s.ok()) {
      st.inflight.push_back(InFlight{std::move(b), req, deadline});
      if (st.inflight.back().batch.update == update_)
        e->report.peak_inflight = std::max<uint64_t>(e->report.peak_inflight, st.inflight.size());
    } else {
      record(e, b, s);
      slot_read_ended(b.slot);
    }
    st.posting.clear();
  }
}

void PipelinedWriter::poll_inflight(Engine* e, ThreadState& st, std::unique_lock<std::mutex>& lk) {
  // Poll the oldest first, backing off while nothing changes (no busy waiting on 2 cores). The
  // wait between rounds is on the engine's queue, so a batch submitted meanwhile is posted at once
  // when there is room for it: that is what keeps two batches in flight per engine.
  const size_t max_inflight = static_cast<size_t>(std::max(1, options_.max_inflight_batches));
  double sleep_s = options_.poll_min_sleep_s;
  std::vector<std::pair<size_t, Status>> returned;
  for (;;) {
    lk.unlock();
    for (size_t i = 0; i < st.inflight.size(); ++i) {
      InFlight& f = st.inflight[i];
      Status s = guarded("poll", [&] { return transport_->poll(f.request); });
      if (s.in_progress() && Clock::now() >= f.deadline) {
        s = Status(Code::kTimeout, "a write of " + std::to_string(f.batch.bytes) + " bytes was still running after " +
                                       std::to_string(options_.transfer_timeout_s) + " s (transfer timeout); cancelled");
      }
      if (!s.in_progress()) returned.emplace_back(i, s);
    }
    if (!returned.empty()) break;
    lk.lock();
    const bool room = e->cv.wait_for(lk, std::chrono::duration<double>(sleep_s), [&] {
      return !e->queue.empty() && st.inflight.size() < max_inflight;
    });
    if (room) {
      post_ready(e, st, lk);
      sleep_s = options_.poll_min_sleep_s;
    } else {
      sleep_s = std::min(sleep_s * 2, options_.poll_max_sleep_s);
    }
  }
  // Release outside the lock (cancels a timed-out write before its slot is reused).
  std::vector<Status> rs;
  for (auto& [i, _] : returned)
    rs.push_back(guarded("release", [&] { return transport_->release(st.inflight[i].request); }));
  lk.lock();
  bool failed = false;
  for (size_t k = returned.size(); k-- > 0;) {
    const size_t i = returned[k].first;
    record(e, st.inflight[i].batch, returned[k].second);
    released(e, st.inflight[i], rs[k]);
    failed |= !returned[k].second.ok();
    st.inflight.erase(st.inflight.begin() + static_cast<long>(i));
  }
  if (failed && !st.inflight.empty()) {
    // The engine failed: cancel what is still in flight rather than wait for its deadline.
    lk.unlock();
    std::vector<Status> cancelled;
    for (auto& f : st.inflight) cancelled.push_back(guarded("release", [&] { return transport_->release(f.request); }));
    lk.lock();
    for (size_t i = 0; i < st.inflight.size(); ++i) {
      if (st.inflight[i].batch.update == update_) e->report.skipped_batches += 1;
      released(e, st.inflight[i], cancelled[i]);
    }
    st.inflight.clear();
  }
}

void PipelinedWriter::run_drain() {
  std::unique_lock<std::mutex> lk(mu_);
  double sleep_s = 1e-3;
  for (;;) {
    drain_cv_.wait(lk, [&] { return drain_stop_ || !draining_.empty(); });
    // At close, writes still draining keep their slots (and the buffer's memory) for good: a leak,
    // never a read of freed memory.
    if (drain_stop_) return;
    std::vector<RequestId> ids;
    for (const Draining& d : draining_) ids.push_back(d.request);
    lk.unlock();
    std::vector<Status> rs;
    for (RequestId id : ids) rs.push_back(guarded("release", [&] { return transport_->release(id); }));
    lk.lock();
    bool progress = false;
    for (size_t k = 0; k < ids.size(); ++k) {
      if (rs[k].code() == Code::kBusy) continue;
      for (auto it = draining_.begin(); it != draining_.end(); ++it) {
        if (it->request != ids[k]) continue;
        slot_read_ended(it->slot);
        draining_.erase(it);
        progress = true;
        break;
      }
    }
    if (progress) {
      sleep_s = 1e-3;
    } else {
      drain_cv_.wait_for(lk, std::chrono::duration<double>(sleep_s), [&] { return drain_stop_; });
      sleep_s = std::min(sleep_s * 2, 0.1);
    }
  }
}

Status PipelinedWriter::finish(std::vector<EngineReport>* report) {
  std::unique_lock<std::mutex> lk(mu_);
  const auto limit = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(options_.transfer_timeout_s));
  // Every posted write has a deadline; a post that never returns is bounded here, so this wait
  // ends within the transfer timeout per queued batch.
  for (;;) {
    const auto now = Clock::now();
    auto wake = Clock::time_point::max();
    bool waiting = false;
    for (auto& [_, e] : engines_) {
      if (!e->busy && e->queue.empty()) continue;
      if (e->in_post) {
        const auto due = e->post_started + limit;
        if (now >= due) {
          EngineReport& r = e->report;
          if (r.state != EngineState::kFailed) {
            r.state = EngineState::kFailed;
            r.code = Code::kTimeout;
            r.error = "a post to engine '" + e->name + "' had not returned after " +
                      std::to_string(options_.transfer_timeout_s) +
                      " s (transfer timeout): the transport is stuck; its slot stays in use until the post returns";
          }
          while (!e->queue.empty()) {
            skip(e.get(), e->queue.front());
            e->queue.pop_front();
          }
          continue;
        }
        wake = std::min(wake, due);
      }
      waiting = true;
    }
    if (!waiting) break;
    if (wake == Clock::time_point::max()) {
      slot_cv_.wait(lk);
    } else {
      slot_cv_.wait_until(lk, wake);
    }
  }
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
  update_ += 1;
  return Status::Ok();
}

int PipelinedWriter::draining_batches() {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(draining_.size());
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
  // Writes in flight end (or reach their deadline) before their thread is joined.
  for (auto& [_, e] : engines) e->thread.join();
  {
    std::lock_guard<std::mutex> lk(mu_);
    drain_stop_ = true;
    drain_cv_.notify_all();
  }
  drain_thread_.join();
}

}  // namespace p2pw
