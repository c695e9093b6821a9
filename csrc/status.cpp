#include "status.h"

namespace p2pw {

const char* code_name(Code c) {
  switch (c) {
    case Code::kInProgress: return "IN_PROGRESS";
    case Code::kOk: return "OK";
    case Code::kInvalidArgument: return "INVALID_ARGUMENT";
    case Code::kTimeout: return "TIMEOUT";
    case Code::kRemoteDisconnected: return "REMOTE_DISCONNECTED";
    case Code::kTransportError: return "TRANSPORT_ERROR";
    case Code::kClosed: return "CLOSED";
    case Code::kNotFound: return "NOT_FOUND";
    case Code::kBusy: return "BUSY";
    case Code::kOutOfRegion: return "OUT_OF_REGION";
    case Code::kDeviceError: return "DEVICE_ERROR";
    case Code::kFenced: return "FENCED";
  }
  return "UNKNOWN";
}

std::string Status::to_string() const {
  std::string s = code_name(code_);
  if (!message_.empty()) s += ": " + message_;
  return s;
}

}  // namespace p2pw
