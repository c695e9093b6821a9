// A Transport whose verbs are methods of a Python object. Mooncake and NIXL ship Python bindings
// but no C/C++ headers, so their backends (python/p2pweights/transport/) are driven from the
// native per-engine threads through this adapter, which holds the GIL only for the call itself.
// A Python exception becomes a Status (its `p2pw_code` attribute, if any, picks the code).
#pragma once

#include <pybind11/pybind11.h>

#include "transport/transport.h"

namespace p2pw {

class PyTransport final : public Transport {
 public:
  explicit PyTransport(pybind11::object backend);
  ~PyTransport() override;

  std::string name() const override { return name_; }
  Status register_memory(uint64_t addr, uint64_t length, const std::string& location) override;
  Status deregister_memory(uint64_t addr) override;
  Status connect(int engine, const std::string& descriptor) override;
  Status disconnect(int engine) override;
  Status post(int engine, const std::vector<WriteDesc>& writes, RequestId* request) override;
  Status poll(RequestId request) override;
  Status release(RequestId request) override;
  void close() override;

  pybind11::object backend() const { return backend_; }

 private:
  template <typename F>
  Status call(const char* verb, F&& f);
  pybind11::object backend_;
  std::string name_;
  bool closed_ = false;
};

}  // namespace p2pw
