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

template <typename F>
Status PyTransport::call(const char* verb, F&& f) {
  py::gil_scoped_acquire gil;
  if (closed_) return Status(Code::kClosed, name_ + " transport is closed");
  try {
    return f();
  } catch (py::error_already_set& e) {
    Code code = Code::kTransportError;
    if (py::hasattr(e.value(), "p2pw_code")) code = static_cast<Code>(e.value().attr("p2pw_code").cast<int>());
    std::string what = py::str(e.value());
    return Status(code, name_ + " " + verb + ": " + what);
  } catch (std::exception& e) {
    return Status(Code::kTransportError, name_ + " " + verb + ": " + e.what());
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
    *request = backend_.attr("post")(engine, local, remote, lengths).cast<RequestId>();
    return Status::Ok();
  });
}

Status PyTransport::poll(RequestId request) {
  return call("poll", [&] {
    py::object r = backend_.attr("poll")(request);
    // An int code, or (code, message) for an error with a reason.
    if (py::isinstance<py::tuple>(r)) {
      py::tuple t = r;
      return Status(static_cast<Code>(t[0].cast<int>()), py::str(t[1]));
    }
    return Status(static_cast<Code>(r.cast<int>()), "");
  });
}

Status PyTransport::release(RequestId request) {
  return call("release", [&] {
    backend_.attr("release")(request);
    return Status::Ok();
  });
}

void PyTransport::close() {
  py::gil_scoped_acquire gil;
  if (closed_) return;
  closed_ = true;
  try {
    backend_.attr("close")();
  } catch (py::error_already_set&) {
    // close is best effort; the backend reports its own failures
  }
}

}  // namespace p2pw
