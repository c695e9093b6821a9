// The thin pybind11 module p2pweights._native. Every blocking call releases the GIL. A non-OK
// Status becomes the matching Python exception through p2pweights.errors.raise_for_status.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iterator>
#include <map>
#include <mutex>

#include "buffers/copy_program.h"
#include "buffers/cuda_runtime.h"
#include "buffers/delta_codec.h"
#include "buffers/delta_apply_gpu.h"
#include "buffers/delta_find.h"
#include "buffers/transfer_buffer.h"
#include "transport/loopback.h"
#include "transport/nixl_transport.h"
#include "transport/py_transport.h"
#include "writer.h"

namespace py = pybind11;
using namespace p2pw;

#ifndef P2PW_VERSION
#define P2PW_VERSION "dev"
#endif

namespace {

void check(const Status& s) {
  if (s.ok()) return;
  py::module_::import("p2pweights.errors").attr("raise_for_status")(static_cast<int>(s.code()), s.message());
  throw std::runtime_error(s.to_string());  // unreachable: raise_for_status always raises
}

// Objects whose destructor joins threads that may need the GIL are destroyed with it released.
template <typename T>
struct GilFreeDelete {
  void operator()(T* p) const {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete p;
    } else {
      delete p;
    }
  }
};

// The exporter behind a slot view: counts as a user of the buffer while any memoryview, numpy
// array or torch tensor made from it is alive, so close() defers the free (see transfer_buffer.h).
struct SlotView {
  py::object owner;  // the TransferBuffer's Python object: it cannot be collected under a view
  TransferBuffer* buffer;
  uint8_t* data;
  size_t length;
  ~SlotView() { buffer->end_use(1); }
};

// The buffer each live writer claimed (TransferBuffer::claim_writer): let go at close() or destruction.
std::mutex g_claims_mu;
std::map<const PipelinedWriter*, TransferBuffer*> g_claims;

TransferBuffer* take_claim(const PipelinedWriter* w) {
  std::lock_guard<std::mutex> lk(g_claims_mu);
  auto it = g_claims.find(w);
  if (it == g_claims.end()) return nullptr;
  TransferBuffer* b = it->second;
  g_claims.erase(it);
  return b;
}

struct WriterDelete {
  void operator()(PipelinedWriter* p) const {
    TransferBuffer* b = take_claim(p);  // before the delete: a new writer may reuse the address
    GilFreeDelete<PipelinedWriter>()(p);
    if (b != nullptr) b->release_writer();
  }
};

py::dict report_to_dict(const EngineReport& r) {
  py::dict d;
  d["engine"] = r.engine;
  d["name"] = r.name;
  d["bytes"] = r.bytes;
  d["writes"] = r.writes;
  d["batches"] = r.batches;
  d["skipped_batches"] = r.skipped_batches;
  d["peak_inflight"] = r.peak_inflight;
  d["seconds"] = r.seconds;
  d["gbps"] = r.gbps;
  d["state"] = engine_state_name(r.state);
  d["code"] = static_cast<int>(r.code);
  d["error"] = r.error;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "p2pweights native core: transfer buffers, transports, the pipelined writer";
  m.attr("__version__") = P2PW_VERSION;

  py::enum_<Code>(m, "Code")
      .value("IN_PROGRESS", Code::kInProgress)
      .value("OK", Code::kOk)
      .value("INVALID_ARGUMENT", Code::kInvalidArgument)
      .value("TIMEOUT", Code::kTimeout)
      .value("REMOTE_DISCONNECTED", Code::kRemoteDisconnected)
      .value("TRANSPORT_ERROR", Code::kTransportError)
      .value("CLOSED", Code::kClosed)
      .value("NOT_FOUND", Code::kNotFound)
      .value("BUSY", Code::kBusy)
      .value("OUT_OF_REGION", Code::kOutOfRegion)
      .value("DEVICE_ERROR", Code::kDeviceError)
      .value("FENCED", Code::kFenced);

  py::tuple nixl_versions(std::size(nixl_capi::kCheckedVersions));
  for (size_t i = 0; i < std::size(nixl_capi::kCheckedVersions); ++i) nixl_versions[i] = nixl_capi::kCheckedVersions[i];
  m.attr("NIXL_CAPI_CHECKED_VERSIONS") = nixl_versions;

  m.def("cuda_runtime_info", [] {
    CudaRuntime& c = CudaRuntime::get();
    py::dict d;
    d["loaded"] = c.loaded();
    d["library"] = c.library();
    d["device_count"] = c.device_count();
    return d;
  }, "Whether a CUDA runtime was found at run time, which library, and how many devices it sees.");

  // Copy programs (csrc/buffers/copy_program.h): return (code, message[, driver calls]) so that the
  // Python edge names the group (copyplans/replay.py); the GIL is released for the copies.
  m.def("cuda_driver_info", [] {
    CudaDriverInfo i = cuda_driver_info();
    py::dict d;
    d["loaded"] = i.loaded;
    d["lanes"] = i.lanes;
    d["kernel"] = i.kernel;
    d["library"] = i.library;
    d["error"] = i.error;
    return d;
  }, "Whether the CUDA driver (libcuda) was found, whether it has streams/events for lanes, and whether the\n"
     "batched copy kernel is embedded (and the driver can load and launch it).");
  auto program_of = [](const py::array_t<int64_t, py::array::c_style>& program, Status* s) -> size_t {
    if (program.ndim() != 2 || program.shape(1) != kCopyColumns) {
      *s = Status(Code::kInvalidArgument, "a copy program is an (n, 7) int64 array");
      return 0;
    }
    return static_cast<size_t>(program.shape(0));
  };
  auto inputs_of = [](const std::vector<uint64_t>& addrs, const std::vector<uint64_t>& nbytes, Status* s) {
    std::vector<CopyInput> in(addrs.size());
    if (addrs.size() != nbytes.size()) *s = Status(Code::kInvalidArgument, "input addresses and sizes differ in length");
    for (size_t i = 0; i < in.size() && i < nbytes.size(); ++i) in[i] = CopyInput{addrs[i], nbytes[i]};
    return in;
  };
  m.def("check_copy_program", [program_of](const py::array_t<int64_t, py::array::c_style>& program, uint64_t dst_bytes,
                                             const std::vector<uint64_t>& input_nbytes) {
    Status s;
    const size_t n = program_of(program, &s);
    if (s.ok()) {
      py::gil_scoped_release nogil;
      s = check_copy_program(program.data(), n, dst_bytes, input_nbytes);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("program"), py::arg("dst_bytes"), py::arg("input_nbytes"),
     "The bounds the run functions check (inside dst_bytes and each input), and that no two descriptors\n"
     "write the same destination byte: (code, message), code 0 when the program may run.");
  m.def("run_copy_program_host", [program_of, inputs_of](const py::array_t<int64_t, py::array::c_style>& program,
                                                         uint64_t slot, uint64_t slot_bytes,
                                                         const std::vector<uint64_t>& input_addrs,
                                                         const std::vector<uint64_t>& input_nbytes, int threads) {
    Status s;
    const size_t n = program_of(program, &s);
    std::vector<CopyInput> in = inputs_of(input_addrs, input_nbytes, &s);
    if (s.ok()) {
      py::gil_scoped_release nogil;
      s = run_host_program(program.data(), n, slot, slot_bytes, in, threads);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("program"), py::arg("slot"), py::arg("slot_bytes"), py::arg("input_addrs"), py::arg("input_nbytes"),
     py::arg("threads") = 1);
  m.def("run_copy_program_cuda", [program_of, inputs_of](const py::array_t<int64_t, py::array::c_style>& program,
                                                         uint64_t slot, uint64_t slot_bytes,
                                                         const std::vector<uint64_t>& input_addrs,
                                                         const std::vector<uint64_t>& input_nbytes, uint64_t stream,
                                                         const std::string& mode, int lanes) {
    Status s;
    int64_t calls = 0;
    const size_t n = program_of(program, &s);
    std::vector<CopyInput> in = inputs_of(input_addrs, input_nbytes, &s);
    if (mode != "each" && mode != "kernel") s = Status(Code::kInvalidArgument, "copy mode must be kernel or each");
    if (s.ok()) {
      py::gil_scoped_release nogil;
      s = run_device_program(program.data(), n, slot, slot_bytes, in, stream,
                             mode == "kernel" ? CopyMode::kKernel : CopyMode::kEach, &calls, lanes);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message(), calls);
  }, py::arg("program"), py::arg("slot"), py::arg("slot_bytes"), py::arg("input_addrs"), py::arg("input_nbytes"),
     py::arg("stream"), py::arg("mode") = "each", py::arg("lanes") = 1);

  // GPU delta kernels (csrc/buffers/delta_find.h; deltas/index_records.py): device addresses and a
  // CUstream handle; each returns (code, message) once the launch is enqueued.
  m.attr("DELTA_BLOCK_BYTES") = kDeltaBlockBytes;
  m.attr("DELTA_GROUPS_PER_BLOCK") = kDeltaGroupsPerBlock;
  m.def("delta_kernels_embedded", &delta_kernels_embedded, "Whether the GPU delta kernels were built in (nvcc).");
  m.def("delta_find_count", [](uint64_t spans, int n_spans, unsigned unit, uint64_t mask, uint64_t counts,
                               unsigned blocks, uint64_t stream) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = delta_find_count(spans, n_spans, unit, mask, counts, blocks, stream);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("spans"), py::arg("n_spans"), py::arg("unit"), py::arg("mask"), py::arg("counts"), py::arg("blocks"),
     py::arg("stream"));
  m.def("delta_find_gather", [](uint64_t spans, int n_spans, unsigned unit, uint64_t mask, uint64_t ends,
                                uint64_t positions, uint64_t values, unsigned blocks, uint64_t stream) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = delta_find_gather(spans, n_spans, unit, mask, ends, positions, values, blocks, stream);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("spans"), py::arg("n_spans"), py::arg("unit"), py::arg("mask"), py::arg("ends"), py::arg("positions"),
     py::arg("values"), py::arg("blocks"), py::arg("stream"));
  m.def("payload_checksum", [](uint64_t words, uint64_t n_words, uint64_t out, uint64_t stream) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = payload_checksum(words, n_words, out, stream);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("words"), py::arg("n_words"), py::arg("out"), py::arg("stream"));
  // An area's index records checked and applied (csrc/buffers/delta_apply_gpu.h; deltas/index_apply.py).
  m.attr("DELTA_CHECK_WORDS") = kDeltaCheckWords;
  m.attr("DELTA_APPLY_ELEMENTS") = kDeltaApplyElements;
  m.def("delta_apply_kernels_embedded", &delta_apply_kernels_embedded,
        "Whether the GPU kernels that check and apply an area's index records were built in (nvcc).");
  m.def("delta_records_check", [](uint64_t records, int n_records, uint64_t verdicts, uint64_t blocks, uint64_t stream) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = delta_records_check(records, n_records, verdicts, blocks, stream);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("records"), py::arg("n_records"), py::arg("verdicts"), py::arg("blocks"), py::arg("stream"));
  m.def("delta_records_apply", [](uint64_t records, int n_records, uint64_t rows, uint64_t blocks, uint64_t stream) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = delta_records_apply(records, n_records, rows, blocks, stream);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("records"), py::arg("n_records"), py::arg("rows"), py::arg("blocks"), py::arg("stream"));

  // Delta records (csrc/buffers/delta_codec.h; p2pweights/deltas): raw addresses, the GIL released.
  auto ptr = [](uint64_t addr) { return reinterpret_cast<uint8_t*>(static_cast<uintptr_t>(addr)); };
  m.def("delta_encode", [ptr](uint64_t cur, uint64_t base, uint64_t nbytes, uint32_t unit, uint64_t out, uint64_t out_cap,
                              bool update_base, int threads) {
    DeltaStats st;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = delta_encode(ptr(cur), ptr(base), nbytes, unit, ptr(out), out_cap, &st, update_base, threads);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message(), st.encoded_bytes, st.changed_bytes, st.runs,
                          std::string(delta_mode_name(st.mode)));
  }, py::arg("cur_addr"), py::arg("base_addr"), py::arg("nbytes"), py::arg("unit"), py::arg("out_addr"),
     py::arg("out_cap"), py::arg("update_base") = false, py::arg("threads") = 1,
     "The delta record of cur against base into out: (code, message, encoded_bytes, changed_bytes, runs, mode),\n"
     "mode 'empty' | 'runs' | 'dense'. update_base: base := cur on the way.");
  m.def("delta_encode_program", [ptr, program_of, inputs_of](const py::array_t<int64_t, py::array::c_style>& program,
                                                              uint64_t slot_bytes, const std::vector<uint64_t>& input_addrs,
                                                              const std::vector<uint64_t>& input_nbytes, uint64_t offset,
                                                              uint64_t nbytes, uint64_t base, uint32_t unit, uint64_t out,
                                                              uint64_t out_cap, int threads) {
    DeltaStats st;
    Status s;
    const size_t n = program_of(program, &s);
    std::vector<CopyInput> in = inputs_of(input_addrs, input_nbytes, &s);
    if (s.ok()) {
      py::gil_scoped_release nogil;
      s = delta_encode_program(program.data(), n, slot_bytes, in, offset, nbytes, ptr(base), unit, ptr(out), out_cap,
                               &st, threads);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message(), st.encoded_bytes, st.changed_bytes, st.runs,
                          std::string(delta_mode_name(st.mode)));
  }, py::arg("program"), py::arg("slot_bytes"), py::arg("input_addrs"), py::arg("input_nbytes"), py::arg("offset"),
     py::arg("nbytes"), py::arg("base_addr"), py::arg("unit"), py::arg("out_addr"), py::arg("out_cap"),
     py::arg("threads") = 1,
     "delta_encode(update_base=True) of slot bytes [offset, offset + nbytes) as the copy program would write them,\n"
     "read from its inputs without writing the slot: (code, message, encoded_bytes, changed_bytes, runs, mode).\n"
     "NOT_FOUND (nothing read or written) where the program leaves a byte of the range unwritten.");
  m.def("delta_max_encoded", &delta_max_encoded, py::arg("nbytes"),
        "The most bytes the record of an nbytes slot takes (header + nbytes).");
  m.def("delta_check", [ptr](uint64_t rec, uint64_t rec_len, uint64_t dst_nbytes) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = delta_check(ptr(rec), rec_len, dst_nbytes);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("rec_addr"), py::arg("rec_len"), py::arg("dst_nbytes"),
     "Every field, the checksum and every run of a record checked against a destination of dst_nbytes: (code, message).");
  m.def("delta_apply", [ptr](uint64_t rec, uint64_t rec_len, uint64_t dst, uint64_t dst_nbytes, bool checked) {
    Status s;
    {
      py::gil_scoped_release nogil;
      s = delta_apply(ptr(rec), rec_len, ptr(dst), dst_nbytes, checked);
    }
    return py::make_tuple(static_cast<int>(s.code()), s.message());
  }, py::arg("rec_addr"), py::arg("rec_len"), py::arg("dst_addr"), py::arg("dst_nbytes"), py::arg("checked") = false,
     "delta_check, then the record's runs copied into dst (nothing written when the check fails): (code, message).\n"
     "checked=True: the caller ran delta_check on these bytes; one copying walk, every run still bounded inside dst\n"
     "(bytes changed since the check may end it partway, with an error).");
  m.def("delta_hash", [ptr](uint64_t addr, uint64_t nbytes, uint64_t seed) {
    py::gil_scoped_release nogil;
    return delta_hash(ptr(addr), nbytes, seed);
  }, py::arg("addr"), py::arg("nbytes"), py::arg("seed") = 0, "The hash of a record's checksum (delta_codec.h).");

  py::class_<SlotView>(m, "SlotView", py::buffer_protocol(),
                       "The exporter of a slot view; holds the transfer buffer open while alive.")
      .def_buffer([](SlotView& v) -> py::buffer_info {
        return py::buffer_info(v.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(v.length)}, {1});
      });

  py::class_<TransferBuffer, std::unique_ptr<TransferBuffer, GilFreeDelete<TransferBuffer>>>(m, "TransferBuffer")
      .def_static("allocate", [](size_t slot_bytes, int num_slots, const std::string& pin) {
        std::unique_ptr<TransferBuffer> b;
        Status s;
        {
          py::gil_scoped_release nogil;  // pinning a GiB takes ~0.4 s
          s = TransferBuffer::allocate_host(slot_bytes, num_slots, pin, &b);
        }
        check(s);
        return std::unique_ptr<TransferBuffer, GilFreeDelete<TransferBuffer>>(b.release());
      }, py::arg("slot_bytes"), py::arg("num_slots") = 2, py::arg("pin") = "auto")
      .def_static("wrap", [](uint64_t addr, size_t slot_bytes, int num_slots, const std::string& location) {
        std::unique_ptr<TransferBuffer> b;
        check(TransferBuffer::wrap(addr, slot_bytes, num_slots, location, &b));
        return std::unique_ptr<TransferBuffer, GilFreeDelete<TransferBuffer>>(b.release());
      }, py::arg("addr"), py::arg("slot_bytes"), py::arg("num_slots"), py::arg("location") = "cpu")
      .def_property_readonly_static("alignment", [](py::object) { return TransferBuffer::kAlignment; })
      .def_property_readonly("address", &TransferBuffer::address)
      .def_property_readonly("slot_bytes", &TransferBuffer::slot_bytes)
      .def_property_readonly("num_slots", &TransferBuffer::num_slots)
      .def_property_readonly("total_bytes", &TransferBuffer::total_bytes)
      .def_property_readonly("location", &TransferBuffer::location)
      .def_property_readonly("pin_mode", [](const TransferBuffer& b) { return pin_mode_name(b.pin_mode()); })
      .def_property_readonly("pin_warning", &TransferBuffer::pin_warning)
      .def_property_readonly("closed", &TransferBuffer::closed)
      .def_property_readonly("released", &TransferBuffer::released,
                             "Whether the memory itself was freed (closed, and no view or write left).")
      .def_property_readonly("users", &TransferBuffer::users, "Live slot views plus batches of writes reading it.")
      .def("slot_address", [](const TransferBuffer& b, int i) {
        if (b.closed()) check(Status(Code::kClosed, "transfer buffer is closed"));
        if (i < 0 || i >= b.num_slots()) check(Status(Code::kInvalidArgument, "slot " + std::to_string(i) + " does not exist"));
        return reinterpret_cast<uint64_t>(b.slot(i));
      })
      .def("slot_view", [](py::object self, int i) {
        TransferBuffer& b = self.cast<TransferBuffer&>();
        if (b.location() != "cpu") check(Status(Code::kInvalidArgument, "a GPU slot has no host view"));
        if (i < 0 || i >= b.num_slots()) check(Status(Code::kInvalidArgument, "slot " + std::to_string(i) + " does not exist"));
        if (!b.begin_use()) check(Status(Code::kClosed, "transfer buffer is closed"));
        py::object exporter = py::cast(new SlotView{self, &b, b.slot(i), b.slot_bytes()}, py::return_value_policy::take_ownership);
        PyObject* view = PyMemoryView_FromObject(exporter.ptr());
        if (view == nullptr) throw py::error_already_set();
        return py::reinterpret_steal<py::memoryview>(view);
      }, "A writable view of slot i without a copy (numpy.frombuffer / torch.frombuffer). While it, or\n"
         "anything made from it, is alive, close() defers freeing the memory.")
      .def("close", &TransferBuffer::close,
           "Refuses new views and writes; frees the memory now, or when the last view or write ends.");

  py::class_<Transport, std::unique_ptr<Transport, GilFreeDelete<Transport>>>(m, "Transport")
      .def_property_readonly("name", &Transport::name)
      .def("register_memory", [](Transport& t, uint64_t addr, uint64_t length, const std::string& location) {
        Status s;
        { py::gil_scoped_release nogil; s = t.register_memory(addr, length, location); }
        check(s);
      }, py::arg("addr"), py::arg("length"), py::arg("location") = "cpu")
      .def("deregister_memory", [](Transport& t, uint64_t addr) {
        Status s;
        { py::gil_scoped_release nogil; s = t.deregister_memory(addr); }
        check(s);
      })
      .def("connect", [](Transport& t, int engine, const std::string& descriptor) {
        Status s;
        { py::gil_scoped_release nogil; s = t.connect(engine, descriptor); }
        check(s);
      })
      .def("disconnect", [](Transport& t, int engine) {
        Status s;
        { py::gil_scoped_release nogil; s = t.disconnect(engine); }
        check(s);
      })
      .def("close", [](Transport& t) { py::gil_scoped_release nogil; t.close(); });

  py::class_<LoopbackTransport, Transport, std::unique_ptr<LoopbackTransport, GilFreeDelete<LoopbackTransport>>>(
      m, "LoopbackTransport")
      .def(py::init<>())
      .def("set_fault", [](LoopbackTransport& t, int engine, double delay_s, int64_t fail_after_bytes, bool hang,
                           bool disconnected, double link_gbps) {
        LoopbackFault f;
        f.delay_s = delay_s;
        f.fail_after_bytes = fail_after_bytes;
        f.hang = hang;
        f.disconnected = disconnected;
        f.link_gbps = link_gbps;
        check(t.set_fault(engine, f));
      }, py::arg("engine"), py::arg("delay_s") = 0.0, py::arg("fail_after_bytes") = -1, py::arg("hang") = false,
         py::arg("disconnected") = false, py::arg("link_gbps") = 0.0)
      .def("bytes_copied", &LoopbackTransport::bytes_copied);

  py::class_<PyTransport, Transport, std::unique_ptr<PyTransport, GilFreeDelete<PyTransport>>>(m, "PyTransport")
      .def(py::init<py::object>(), py::arg("backend"))
      .def_property_readonly("backend", &PyTransport::backend);

  py::class_<NixlTransport, Transport, std::unique_ptr<NixlTransport, GilFreeDelete<NixlTransport>>>(
      m, "NixlTransport",
      "NIXL through its C API (dlopen'ed from `library`): posted and polled without the GIL.")
      .def(py::init([](const std::string& library, const std::string& agent_name, const std::string& plugin,
                       uint64_t progress_delay_us) {
             NixlOptions o;
             o.library = library;
             o.agent_name = agent_name;
             o.plugin = plugin;
             o.progress_delay_us = progress_delay_us;
             std::unique_ptr<NixlTransport> t;
             Status s;
             {
               py::gil_scoped_release nogil;  // agent and plugin start-up takes a while
               s = NixlTransport::create(o, &t);
             }
             check(s);
             return std::unique_ptr<NixlTransport, GilFreeDelete<NixlTransport>>(t.release());
           }),
           py::arg("library"), py::arg("agent_name"), py::arg("plugin") = "UCX", py::arg("progress_delay_us") = 1000)
      .def("connect_peer", [](NixlTransport& t, int engine, py::bytes agent_metadata, const std::string& location) {
        std::string md = agent_metadata;
        Status s;
        { py::gil_scoped_release nogil; s = t.connect_peer(engine, md, location); }
        check(s);
      }, py::arg("engine"), py::arg("agent_metadata"), py::arg("location") = "cpu",
         "Connect an engine from its published agent metadata (decoded) and memory location.")
      .def_property_readonly("agent_name", &NixlTransport::agent_name)
      .def_property_readonly("plugin", &NixlTransport::plugin)
      .def_property_readonly("library", &NixlTransport::library)
      .def("stats", [](const NixlTransport& t) {
        NixlStats s = t.stats();
        py::dict d;
        d["requests_made"] = s.requests_made;
        d["requests_reposted"] = s.requests_reposted;
        d["kept"] = s.kept;
        d["draining"] = s.draining;
        return d;
      }, "Transfer requests created, re-posted from the kept ones, kept now, and refused releases pending.");

  py::class_<PipelinedWriter, std::unique_ptr<PipelinedWriter, WriterDelete>>(m, "PipelinedWriter")
      .def(py::init([](Transport* t, TransferBuffer* b, double timeout_s, int max_inflight) {
             if (b->closed()) check(Status(Code::kClosed, "transfer buffer is closed"));
             if (!(timeout_s > 0)) check(Status(Code::kInvalidArgument, "transfer timeout must be positive"));
             if (max_inflight < 1) check(Status(Code::kInvalidArgument, "max_inflight_batches must be at least 1"));
             WriterOptions o;
             o.transfer_timeout_s = timeout_s;
             o.max_inflight_batches = max_inflight;
             if (!b->claim_writer())
               check(Status(Code::kBusy, "the transfer buffer already has a writer: its slots are that writer's to "
                                         "acquire and write from; close it first"));
             std::unique_ptr<PipelinedWriter> w;
             try {
               w = std::make_unique<PipelinedWriter>(t, b, o);
             } catch (...) {
               b->release_writer();
               throw;
             }
             {
               std::lock_guard<std::mutex> lk(g_claims_mu);
               g_claims[w.get()] = b;
             }
             return std::unique_ptr<PipelinedWriter, WriterDelete>(w.release());
           }),
           py::arg("transport"), py::arg("buffer"), py::arg("transfer_timeout") = 30.0,
           py::arg("max_inflight_batches") = 2,
           py::keep_alive<1, 2>(), py::keep_alive<1, 3>())
      .def_property_readonly("transfer_timeout", &PipelinedWriter::transfer_timeout_s)
      .def("add_engine", [](PipelinedWriter& w, int engine, const std::string& name,
                            const std::vector<std::pair<uint64_t, uint64_t>>& regions) {
        std::vector<Region> r;
        for (auto& [a, n] : regions) r.push_back(Region{a, n});
        check(w.add_engine(engine, name, std::move(r)));
      }, py::arg("engine"), py::arg("name"), py::arg("regions"))
      .def("fence", [](PipelinedWriter& w, int engine, double seconds) { check(w.fence(engine, seconds)); },
           py::arg("engine"), py::arg("seconds"))
      .def("remove_engine", [](PipelinedWriter& w, int engine) {
        Status s;
        { py::gil_scoped_release nogil; s = w.remove_engine(engine); }
        check(s);
      })
      .def("acquire", [](PipelinedWriter& w, double timeout_s) {
        int slot = -1;
        Status s;
        { py::gil_scoped_release nogil; s = w.acquire(&slot, timeout_s); }
        check(s);
        return slot;
      }, py::arg("timeout") = -1.0, "Blocks (GIL released) until a slot has no writes reading it.")
      .def("release_slot", [](PipelinedWriter& w, int slot) { check(w.release_slot(slot)); })
      .def("submit", [](PipelinedWriter& w, int slot, py::array_t<int64_t, py::array::forcecast> offsets,
                        py::array_t<int64_t, py::array::forcecast> lengths,
                        py::array_t<int32_t, py::array::forcecast> engines,
                        py::array_t<uint64_t, py::array::forcecast> remote_addrs) {
        const ssize_t n = offsets.size();
        if (lengths.size() != n || engines.size() != n || remote_addrs.size() != n)
          check(Status(Code::kInvalidArgument, "offsets, lengths, engines and remote addresses differ in length"));
        auto o = offsets.unchecked<1>();
        auto l = lengths.unchecked<1>();
        auto e = engines.unchecked<1>();
        auto r = remote_addrs.unchecked<1>();
        std::vector<Write> writes(n);
        for (ssize_t i = 0; i < n; ++i) {
          if (o(i) < 0 || l(i) <= 0)
            check(Status(Code::kInvalidArgument, "write " + std::to_string(i) + " has offset " + std::to_string(o(i)) +
                                                     " and length " + std::to_string(l(i)) +
                                                     "; offsets must be >= 0 and lengths > 0"));
          writes[i] = Write{static_cast<uint64_t>(o(i)), static_cast<uint64_t>(l(i)), e(i), r(i)};
        }
        Status s;
        { py::gil_scoped_release nogil; s = w.submit(slot, writes); }
        check(s);
      }, py::arg("slot"), py::arg("offsets"), py::arg("lengths"), py::arg("engines"), py::arg("remote_addrs"))
      .def("pending_batches", &PipelinedWriter::pending_batches,
           "Batches still reading the slot (queued, in flight, or released but not let go by the transport).")
      .def("draining_batches", &PipelinedWriter::draining_batches,
           "Released writes that the transport could not cancel and that may still read their slots.")
      .def("finish", [](PipelinedWriter& w) {
        std::vector<EngineReport> rep;
        Status s;
        { py::gil_scoped_release nogil; s = w.finish(&rep); }
        check(s);
        py::list out;
        for (auto& r : rep) out.append(report_to_dict(r));
        return out;
      }, "Waits (GIL released) for every queued write; returns one dict per engine and starts a new update.")
      .def("close", [](PipelinedWriter& w) {
        py::gil_scoped_release nogil;
        w.close();
        if (TransferBuffer* b = take_claim(&w)) b->release_writer();  // another writer may take the buffer
      });
}
