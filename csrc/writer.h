// The pipelined writer: N slots of a transfer buffer, one write thread per engine, each with its
// own queue, so a stuck engine delays only its own writes. A slot is handed out again (acquire)
// only after every write reading it has returned: done, failed, or timed out and released — and a
// write the transport could not cancel (release() answered kBusy) keeps its slot until a drain
// thread sees the transport let go of it. Threads never throw: every error, a transport's
// exception included, is recorded per engine and returned by finish().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "buffers/transfer_buffer.h"
#include "status.h"
#include "transport/transport.h"

namespace p2pw {

// One write of a slot's bytes: [slot_offset, slot_offset + length) to `remote_addr` on `engine`.
struct Write {
  uint64_t slot_offset;
  uint64_t length;
  int engine;
  uint64_t remote_addr;
};

// A memory region an engine published; every write must lie inside one.
struct Region {
  uint64_t addr;
  uint64_t length;
};

struct WriterOptions {
  double transfer_timeout_s = 30.0;
  // Poller backoff (no busy waiting: these machines have 2 cores).
  double poll_min_sleep_s = 20e-6;
  double poll_max_sleep_s = 2e-3;
  // Batches one engine may have posted and not yet completed. Two hide a transport's fixed cost
  // per transfer (NIXL's request setup, Mooncake's gaps) behind the previous slot's bytes.
  int max_inflight_batches = 2;
};

// An engine's state in one update: idle (nothing written yet), ok, or failed (its first error kept).
enum class EngineState { kIdle, kOk, kFailed };
const char* engine_state_name(EngineState s);  // "idle" | "ok" | "failed": the Python EngineState values

struct EngineReport {
  int engine = 0;
  std::string name;
  uint64_t bytes = 0;
  uint64_t writes = 0;
  uint64_t batches = 0;
  uint64_t skipped_batches = 0;  // batches not posted because the engine had already failed
  uint64_t peak_inflight = 0;    // most batches posted and not yet returned at once
  double seconds = 0.0;          // first post to last completion in this update
  double gbps = 0.0;
  EngineState state = EngineState::kIdle;
  Code code = Code::kOk;
  std::string error;
};

class PipelinedWriter {
 public:
  PipelinedWriter(Transport* transport, TransferBuffer* buffer, WriterOptions options);
  ~PipelinedWriter();
  PipelinedWriter(const PipelinedWriter&) = delete;
  PipelinedWriter& operator=(const PipelinedWriter&) = delete;

  // Starts the engine's write thread. `regions` are what the engine published.
  Status add_engine(int engine, const std::string& name, std::vector<Region> regions);
  // Refused while the engine has writes in flight.
  Status remove_engine(int engine);
  // The data plane obeys the session: from `seconds` from now on (the owner's lease, less a margin,
  // as the sender last renewed it) no batch is posted to `engine`; a batch due later fails the
  // engine with kFenced. Checked right before each post, on the write thread's own clock, so a
  // sender that was stopped (SIGSTOP, a GC pause, a partition) and resumes past its lease posts
  // nothing more. A negative value fences at once; +inf lifts the fence (engines without a lease).
  Status fence(int engine, double seconds);

  // Blocks until a slot has no writes reading it; timeout_s < 0 waits without a limit, except
  // that once every slot has been held past the transfer timeout by writes the transport could
  // not cancel it returns kBusy naming their engines (never a silent hang).
  Status acquire(int* slot, double timeout_s = -1.0);
  // Returns an acquired slot unused (e.g. the loaders failed).
  Status release_slot(int slot);
  // Validates every write (inside the slot, known engine, positive length, inside a published
  // region) before posting any; then queues one batch per engine. The slot is free again when the
  // last batch reading it returns.
  Status submit(int slot, const std::vector<Write>& writes);
  // Waits for every queued batch, returns the per-engine report and starts a new update. An engine
  // whose transport has been inside one post for longer than the transfer timeout is reported
  // failed rather than waited for (its later batches of this update are skipped).
  Status finish(std::vector<EngineReport>* report);

  int pending_batches(int slot);
  int draining_batches();  // released writes the transport has not let go of yet
  double transfer_timeout_s() const { return options_.transfer_timeout_s; }
  void close();  // joins the threads; safe twice

 private:
  struct Batch {
    int slot;
    std::vector<WriteDesc> writes;
    uint64_t bytes = 0;
    uint64_t update = 0;  // the update it belongs to: a late return never lands in a newer report
  };
  struct Engine {
    int id;
    std::string name;
    std::vector<Region> regions;  // sorted by addr
    std::deque<Batch> queue;
    bool busy = false;
    bool stop = false;
    bool in_post = false;  // inside transport->post since post_started (finish bounds it)
    std::chrono::steady_clock::time_point post_until = std::chrono::steady_clock::time_point::max();  // fence()
    std::chrono::steady_clock::time_point post_started;
    std::condition_variable cv;
    std::thread thread;
    EngineReport report;
    bool started = false;
    std::chrono::steady_clock::time_point first_post, last_done;
  };
  struct InFlight {
    Batch batch;
    RequestId request;
    std::chrono::steady_clock::time_point deadline;
  };
  // A released write that may still read its slot (the transport answered kBusy).
  struct Draining {
    RequestId request;
    int slot;
    std::string engine;
  };
  // What one engine thread holds outside the lock; kept across a caught exception so that every
  // batch is accounted for and no slot stays locked.
  struct ThreadState {
    std::deque<InFlight> inflight;  // posted, oldest first
    std::vector<Batch> posting;     // popped from the queue, not yet in flight (0 or 1)
  };
  void run_engine(Engine* e);
  void engine_loop(Engine* e, ThreadState& st);
  void post_ready(Engine* e, ThreadState& st, std::unique_lock<std::mutex>& lk);
  void poll_inflight(Engine* e, ThreadState& st, std::unique_lock<std::mutex>& lk);
  void engine_threw(Engine* e, ThreadState& st, const std::string& what);
  void run_drain();
  Status check_write(const Write& w) const;  // mu_ held
  void record(Engine* e, const Batch& b, const Status& s);  // mu_ held
  // The write reading `slot` was released: Ok frees its read, kBusy hands it to the drain thread.
  void released(Engine* e, const InFlight& f, const Status& release_status);  // mu_ held
  void slot_read_ended(int slot);  // mu_ held
  void skip(Engine* e, const Batch& b);  // mu_ held
  // Transport verbs never throw by contract; a backend that does anyway becomes a status here.
  template <typename F>
  Status guarded(const char* verb, F&& f);

  Transport* transport_;
  TransferBuffer* buffer_;
  WriterOptions options_;
  std::mutex mu_;
  std::condition_variable slot_cv_;
  std::vector<int> slot_pending_;   // batches still reading each slot
  std::vector<bool> slot_acquired_;
  int next_slot_ = 0;
  std::map<int, std::unique_ptr<Engine>> engines_;
  uint64_t update_ = 0;
  std::list<Draining> draining_;
  std::condition_variable drain_cv_;
  bool drain_stop_ = false;
  std::thread drain_thread_;
  bool closed_ = false;
};

}  // namespace p2pw
