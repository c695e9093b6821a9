// The few functions of NIXL's C API (libnixl_capi.so) that the native NIXL transport uses, loaded
// with dlopen at run time: the wheels (nixl-cu12 / nixl-cu13) ship the library but no headers, and
// the native module must import where NIXL is absent.
//
// Declarations follow ai-dynamo/nixl src/bindings/rust/wrapper.h (commit 8770b655a, the newest in
// our snapshot; no 1.5.1 tag there), checked against the nixl-cu12 1.5.1 wheel's library: every
// symbol is exported (`nm -D`), and nixl_capi_create_configured_agent reads the config at the
// offsets below (0,1: bools; 4: port; 8: sync; 16, 24: delays; 32: telemetry; objdump).
// kCheckedVersions lists the releases so checked; any other release takes NIXL's Python API
// (p2pweights.transport.nixl_native reads the list as _native.NIXL_CAPI_CHECKED_VERSIONS).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "status.h"

namespace p2pw::nixl_capi {

// The NIXL wheel versions (nixl-cu12 / nixl-cu13) whose libnixl_capi.so these declarations were
// checked against, as above. Add a release only after checking its symbols and config layout.
constexpr const char* kCheckedVersions[] = {"1.5.1"};

// nixl_capi_status_t
enum Result : int {
  kSuccess = 0,
  kInProgress = 1,
  kInvalidParam = -1,
  kBackend = -2,
  kInvalidState = -3,
  kException = -4,
  kNotFound = -6,
};

// nixl_capi_mem_type_t (values of nixl_mem_t)
enum MemType : int { kDram = 0, kVram = 1 };
// nixl_capi_xfer_op_t
enum XferOp : int { kRead = 0, kWrite = 1 };
// nixl_capi_thread_sync_t
enum ThreadSync : int { kSyncNone = 0, kSyncStrict = 1, kSyncRw = 2 };

// Opaque handles (pointers to NIXL's wrapper structs).
using Agent = struct agent_s*;
using Params = struct params_s*;
using MemList = struct mem_list_s*;
using BackendHandle = struct backend_s*;
using XferDlist = struct xfer_dlist_s*;
using RegDlist = struct reg_dlist_s*;
using XferReq = struct xfer_req_s*;
using OptArgs = struct opt_args_s*;

// nixl_capi_agent_config_t
struct AgentConfig {
  bool enable_prog_thread;
  bool enable_listen_thread;
  int listen_port;
  int thread_sync;
  unsigned int num_workers;
  uint64_t pthr_delay_us;
  uint64_t lthr_delay_us;
  bool capture_telemetry;
};
static_assert(offsetof(AgentConfig, thread_sync) == 8 && offsetof(AgentConfig, pthr_delay_us) == 16 &&
                  offsetof(AgentConfig, capture_telemetry) == 32,
              "nixl_capi_agent_config_t layout of NIXL 1.5.1");

// The function table, resolved from one loaded library.
struct Api {
  int (*create_configured_agent)(const char* name, const AgentConfig* cfg, Agent* agent);
  int (*destroy_agent)(Agent agent);
  int (*get_plugin_params)(Agent agent, const char* plugin, MemList* mems, Params* params);
  int (*destroy_mem_list)(MemList list);
  int (*destroy_params)(Params params);
  int (*create_backend)(Agent agent, const char* plugin, Params params, BackendHandle* backend);
  int (*destroy_backend)(BackendHandle backend);
  int (*get_local_md)(Agent agent, void** data, size_t* len);
  int (*load_remote_md)(Agent agent, const void* data, size_t len, char** agent_name);
  int (*invalidate_remote_md)(Agent agent, const char* remote_agent);
  int (*create_reg_dlist)(int mem_type, RegDlist* dlist);
  int (*destroy_reg_dlist)(RegDlist dlist);
  int (*reg_dlist_add_desc)(RegDlist dlist, uintptr_t addr, size_t len, uint64_t dev_id, const void* meta,
                            size_t meta_len);
  int (*register_mem)(Agent agent, RegDlist dlist, OptArgs opt_args);
  int (*deregister_mem)(Agent agent, RegDlist dlist, OptArgs opt_args);
  int (*create_xfer_dlist)(int mem_type, XferDlist* dlist);
  int (*destroy_xfer_dlist)(XferDlist dlist);
  int (*xfer_dlist_add_desc)(XferDlist dlist, uintptr_t addr, size_t len, uint64_t dev_id);
  int (*create_xfer_req)(Agent agent, int op, XferDlist local, XferDlist remote, const char* remote_agent,
                         XferReq* req, OptArgs opt_args);
  int (*post_xfer_req)(Agent agent, XferReq req, OptArgs opt_args);
  int (*get_xfer_status)(Agent agent, XferReq req);
  int (*release_xfer_req)(Agent agent, XferReq req);
  int (*destroy_xfer_req)(XferReq req);
  bool (*is_stub)();

  std::string library;
};

// Loads the library at `path` once per process: later calls return the same table whatever their
// path (one NIXL per process), or the first failure; a path dlopen refused is not tried again.
// Never throws; a missing library or symbol is kNotFound naming it.
Status load(const std::string& path, const Api** api);

// "NIXL C API error -2 (backend)" for messages.
std::string describe(int result);

}  // namespace p2pw::nixl_capi
