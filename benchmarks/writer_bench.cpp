// C++ microbenchmark of the pipelined writer over the loopback transport (no Python in the loop).
// Same table as `p2pweights bench writer`: fill alone, write alone (emulated link), pipelined,
// overlap efficiency = max(fill, write) / pipelined, and every byte checked at the receiver.
//
//   cmake -S . -B build/bench -DP2PW_BUILD_BENCHMARKS=ON && cmake --build build/bench -t writer_bench
//   ./build/bench/writer_bench [total_MiB=1024] [link_gbps=0 (= fill rate)] [--json]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "buffers/transfer_buffer.h"
#include "transport/loopback.h"
#include "writer.h"

using namespace p2pw;
using Clock = std::chrono::steady_clock;

static double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

static void die(const Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "%s: %s\n", what, s.to_string().c_str());
  std::exit(1);
}

struct Row {
  size_t slot, bytes;
  double fill, write, pipe;
  size_t wrong;
};

static Row run_one(size_t slot_bytes, size_t total, double link_gbps) {
  total = std::max(total, 4 * slot_bytes) / slot_bytes * slot_bytes;
  const size_t chunks = total / slot_bytes;
  std::vector<uint8_t> src(total), dst(total, 0);
  std::mt19937_64 rng(slot_bytes);
  for (size_t i = 0; i < total; i += 8) { uint64_t v = rng(); std::memcpy(&src[i], &v, std::min<size_t>(8, total - i)); }

  std::unique_ptr<TransferBuffer> buf;
  die(TransferBuffer::allocate_host(slot_bytes, 2, "auto", &buf), "allocate");
  LoopbackTransport t;
  die(t.register_memory(buf->address(), buf->total_bytes(), "cpu"), "register");
  die(t.connect(0, "loopback"), "connect");
  PipelinedWriter w(&t, buf.get(), WriterOptions{600.0});
  die(w.add_engine(0, "bench-engine", {Region{reinterpret_cast<uint64_t>(dst.data()), dst.size()}}), "add_engine");
  const uint64_t dst0 = reinterpret_cast<uint64_t>(dst.data());
  std::vector<EngineReport> rep;

  auto t0 = Clock::now();
  for (size_t c = 0; c < chunks; ++c) std::memcpy(buf->slot(c % 2), &src[c * slot_bytes], slot_bytes);
  double fill = since(t0);
  LoopbackFault f;
  f.link_gbps = link_gbps > 0 ? link_gbps : total / fill / 1e9;
  die(t.set_fault(0, f), "set_fault");

  t0 = Clock::now();
  for (size_t c = 0; c < chunks; ++c) {
    int s;
    die(w.acquire(&s), "acquire");
    die(w.submit(s, {Write{0, slot_bytes, 0, dst0 + c * slot_bytes}}), "submit");
  }
  die(w.finish(&rep), "finish");
  double write = since(t0);

  std::memset(dst.data(), 0, dst.size());
  t0 = Clock::now();
  for (size_t c = 0; c < chunks; ++c) {
    int s;
    die(w.acquire(&s), "acquire");
    std::memcpy(buf->slot(s), &src[c * slot_bytes], slot_bytes);
    die(w.submit(s, {Write{0, slot_bytes, 0, dst0 + c * slot_bytes}}), "submit");
  }
  die(w.finish(&rep), "finish");
  double pipe = since(t0);
  size_t wrong = 0;
  for (size_t i = 0; i < total; ++i) wrong += src[i] != dst[i];
  w.close();
  t.close();
  return Row{slot_bytes, total, fill, write, pipe, wrong};
}

int main(int argc, char** argv) {
  size_t total = (argc > 1 && argv[1][0] != '-') ? std::strtoull(argv[1], nullptr, 10) << 20 : 1024ull << 20;
  double link = (argc > 2 && argv[2][0] != '-') ? std::atof(argv[2]) : 0.0;
  bool json = false;
  for (int i = 1; i < argc; ++i) json |= std::string(argv[i]) == "--json";
  std::vector<Row> rows;
  for (size_t mib : {4, 16, 64, 256}) rows.push_back(run_one(mib << 20, total, link));
  if (json) {
    std::printf("[\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::printf("  {\"slot_bytes\": %zu, \"slots\": 2, \"bytes\": %zu, \"seconds\": %.6f, \"gbps\": %.3f, "
                  "\"overlap_efficiency\": %.3f, \"wrong_bytes\": %zu}%s\n",
                  r.slot, r.bytes, r.pipe, r.bytes / r.pipe / 1e9, std::max(r.fill, r.write) / r.pipe, r.wrong,
                  i + 1 < rows.size() ? "," : "");
    }
    std::printf("]\n");
    return 0;
  }
  std::printf("%10s %6s %12s %8s %8s %11s %7s %11s %7s\n", "slot MiB", "slots", "bytes", "fill s", "write s",
              "pipelined s", "GB/s", "overlap eff", "#wrong");
  size_t wrong = 0;
  for (const Row& r : rows) {
    std::printf("%10zu %6d %12zu %8.3f %8.3f %11.3f %7.2f %11.3f %7zu\n", r.slot >> 20, 2, r.bytes, r.fill, r.write,
                r.pipe, r.bytes / r.pipe / 1e9, std::max(r.fill, r.write) / r.pipe, r.wrong);
    wrong += r.wrong;
  }
  std::printf("# %s (%zu wrong bytes)\n", wrong ? "FAILED" : "OK", wrong);
  return wrong ? 1 : 0;
}
