#include "transport/py_transport.h"

namespace py = pybind11;

namespace p2pw {

PyTransport::PyTransport(py::object backend) : backend_(std::move(backend)) {
  name_ = py::str(backend_.attr("name"));
}

PyTransport::~PyTransport() {
  py::gil_scoped_acquire gil;
  backend_ = py::object();
}

namespace {

// A Python object's str() without letting a second exception escape.
std::string describe(py::handle obj) {
  try {
    return py::str(obj);
  } catch (...) {
    PyErr_Clear();
    return "<unprintable " + std::string(Py_TYPE(obj.ptr())->tp_name) + ">";
  }
}

}  // namespace

template <typename F>
Status PyTransport::call(const char* verb, F&& f) {
  py::gil_scoped_acquire gil;
  if (closed_) return Status(Code::kClosed, name_ + " transport is closed");
  const std::string where = name_ + " " + verb + ": ";
  try {
    return f();
  } catch (py::error_already_set& e) {
    // Nothing in here may throw again: this runs on a native write thread (invariant: errors are data).
    Code code = Code::kTransportError;
    try {
      py::object c = py::getattr(e.value(), "p2pw_code", py::none());
      if (py::isinstance<py::int_>(c) && is_error_code(c.cast<long>())) code = static_cast<Code>(c.cast<long>());
    } catch (...) {
      PyErr_Clear();
    }
    return Status(code, where + describe(e.value()));
  } catch (const std::exception& e) {
    return Status(Code::kTransportError, where + e.what());
  } catch (...) {
    return Status(Code::kTransportError, where + "an unknown C++ exception");
  }
}

Status PyTransport::register_memory(uint64_t addr, uint64_t length, const std::string& location) {
  return call("register_memory", [&] {
    backend_.attr("register_memory")(addr, length, location);
    return Status::Ok();
  });
}

Status PyTransport::deregister_memory(uint64_t addr) {
  return call("deregister_memory", [&] {
    backend_.attr("deregister_memory")(addr);
    return Status::Ok();
  });
}

Status PyTransport::connect(int engine, const std::string& descriptor) {
  return call("connect", [&] {
    backend_.attr("connect")(engine, descriptor);
    return Status::Ok();
  });
}

Status PyTransport::disconnect(int engine) {
  return call("disconnect", [&] {
    backend_.attr("disconnect")(engine);
    return Status::Ok();
  });
}

Status PyTransport::post(int engine, const std::vector<WriteDesc>& writes, RequestId* request) {
  return call("post", [&] {
    py::list local(writes.size()), remote(writes.size()), lengths(writes.size());
    for (size_t i = 0; i < writes.size(); ++i) {
      local[i] = py::int_(writes[i].local_addr);
      remote[i] = py::int_(writes[i].remote_addr);
      lengths[i] = py::int_(writes[i].length);
    }
    py::object r = backend_.attr("post")(engine, local, remote, lengths);
    if (!py::isinstance<py::int_>(r) || r.cast<py::int_>() < py::int_(0))
      return Status(Code::kTransportError, name_ + " post returned " + describe(r) + ", not a request id (an int >= 0)");
    *request = r.cast<RequestId>();
    return Status::Ok();
  });
}

Status PyTransport::poll(RequestId request) {
  return call("poll", [&] {
    py::object r = backend_.attr("poll")(request);
    // An int code, or (code, message) for an error with a reason.
    py::object code = r;
    std::string message;
    if (py::isinstance<py::tuple>(r) && py::len(r) == 2) {
      code = r.cast<py::tuple>()[0];
      message = describe(r.cast<py::tuple>()[1]);
    }
    if (!py::isinstance<py::int_>(code))
      return Status(Code::kTransportError, name_ + " poll returned " + describe(r) + ", not a status code");
    const long c = code.cast<long>();
    if (c == static_cast<long>(Code::kInProgress) || c == static_cast<long>(Code::kOk)) return Status(static_cast<Code>(c), "");
    if (!is_error_code(c))
      return Status(Code::kTransportError, name_ + " poll returned " + describe(r) + ", not a status code");
    return Status(static_cast<Code>(c), message);
  });
}

Status PyTransport::release(RequestId request) {
  return call("release", [&] {
    // None (or 0): let go. 1 (IN_PROGRESS): a write it could not cancel may still read the local
    // memory; the writer asks again later and keeps the slot meanwhile.
    py::object r = backend_.attr("release")(request);
    if (py::isinstance<py::int_>(r) && r.cast<long>() == static_cast<long>(Code::kInProgress))
      return Status(Code::kBusy, name_ + " release: a write that cannot be cancelled is still reading its slot");
    return Status::Ok();
  });
}

void PyTransport::close() {
  py::gil_scoped_acquire gil;
  if (closed_) return;
  closed_ = true;
  try {
    backend_.attr("close")();
  } catch (...) {
    // close is best effort; the backend reports its own failures
    PyErr_Clear();
  }
}

}  // namespace p2pw
