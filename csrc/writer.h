// The pipelined writer: N slots of a transfer buffer, one write thread per engine, each with its
// own queue, so a stuck engine delays only its own writes. A slot is handed out again (acquire)
// only after every write reading it has returned: done, failed, or timed out and released.
// Threads never throw; what happened is recorded per engine and returned by finish().
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
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

enum class EngineState { kIdle, kOk, kFailed };

struct EngineReport {
  int engine = 0;
  std::string name;
  uint64_t bytes = 0;
  uint64_t writes = 0;
  uint64_t batches = 0;
  uint64_t skipped_batches = 0;  // batches not posted because the engine had already failed
  double seconds = 0.0;          // first post to last completion in this update
  double gbps = 0.0;
  std::string state = "idle";    // idle | ok | failed
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

  // Blocks until a slot has no writes reading it; timeout_s < 0 waits forever.
  Status acquire(int* slot, double timeout_s = -1.0);
  // Returns an acquired slot unused (e.g. the loaders failed).
  Status release_slot(int slot);
  // Validates every write (inside the slot, known engine, positive length, inside a published
  // region) before posting any; then queues one batch per engine. The slot is free again when the
  // last batch reading it returns.
  Status submit(int slot, const std::vector<Write>& writes);
  // Waits for every queued batch, returns the per-engine report and starts a new update.
  Status finish(std::vector<EngineReport>* report);

  int pending_batches(int slot);
  double transfer_timeout_s() const { return options_.transfer_timeout_s; }
  void close();  // joins the threads; safe twice

 private:
  struct Batch {
    int slot;
    std::vector<WriteDesc> writes;
    uint64_t bytes;
  };
  struct Engine {
    int id;
    std::string name;
    std::vector<Region> regions;  // sorted by addr
    std::deque<Batch> queue;
    bool busy = false;
    bool stop = false;
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
  void run_engine(Engine* e);
  Status check_write(const Write& w) const;  // mu_ held
  void batch_returned(Engine* e, const Batch& b, const Status& s);  // mu_ held

  Transport* transport_;
  TransferBuffer* buffer_;
  WriterOptions options_;
  std::mutex mu_;
  std::condition_variable slot_cv_;
  std::vector<int> slot_pending_;   // batches still reading each slot
  std::vector<bool> slot_acquired_;
  int next_slot_ = 0;
  std::map<int, std::unique_ptr<Engine>> engines_;
  bool closed_ = false;
};

}  // namespace p2pw
