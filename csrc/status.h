// Status values: errors inside the native core are data, never exceptions (STYLE.md habit 1).
// "In progress" is not an error. The Python edge maps each code to its own exception class
// (p2pweights/errors.py builds that map from _native.Code, which bindings.cpp makes of this enum).
#pragma once

#include <string>
#include <utility>

namespace p2pw {

enum class Code : int {
  kInProgress = 1,
  kOk = 0,
  kInvalidArgument = -1,   // a bad request, caught before anything is posted
  kTimeout = -2,           // past the write deadline; cancelled and released
  kRemoteDisconnected = -3,  // the peer went away
  kTransportError = -4,    // the transport reported a failure
  kClosed = -5,            // the object was closed
  kNotFound = -6,          // unknown engine, slot or handle
  kBusy = -7,              // refused because something is still in flight
  kOutOfRegion = -8,       // a write outside every region the peer published (or a copy outside its slot)
  kDeviceError = -9,       // a CUDA driver or runtime call failed (copy programs, the copy kernel, pinning)
  kFenced = -10,           // refused before posting: the session's lease no longer covers this engine's writes
};
// Every error code lies in [kLowestCode, -1]: keep the lowest code here when adding one.
constexpr Code kLowestCode = Code::kFenced;
inline bool is_error_code(long c) { return c < 0 && c >= static_cast<long>(kLowestCode); }

const char* code_name(Code c);

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }
  static Status InProgress() { return Status(Code::kInProgress, ""); }

  bool ok() const { return code_ == Code::kOk; }
  bool in_progress() const { return code_ == Code::kInProgress; }
  bool is_error() const { return static_cast<int>(code_) < 0; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string to_string() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

}  // namespace p2pw
