#include "transport/nixl_capi.h"

#include <dlfcn.h>

#include <map>
#include <mutex>

namespace p2pw::nixl_capi {

namespace {

std::mutex g_mu;
Api g_api;
const Api* g_loaded = nullptr;
Status g_failure;
std::map<std::string, Status> g_dlopen_failures;  // by path: a library that would not load stays so

template <typename F>
bool resolve(void* lib, const char* symbol, F* slot, std::string* missing) {
  void* p = dlsym(lib, symbol);
  if (p == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += symbol;
    return false;
  }
  *slot = reinterpret_cast<F>(p);
  return true;
}

}  // namespace

Status load(const std::string& path, const Api** api) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_loaded != nullptr) {
    *api = g_loaded;
    return Status::Ok();
  }
  if (!g_failure.ok()) return g_failure;
  auto refused = g_dlopen_failures.find(path);
  if (refused != g_dlopen_failures.end()) return refused->second;
  // RTLD_LOCAL: our table is the only user of these symbols; libnixl.so itself is shared with the
  // Python bindings when they are loaded too (same path, one copy per process).
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    return g_dlopen_failures[path] =
               Status(Code::kNotFound, "cannot load NIXL's C API from " + path + ": " + (why ? why : "dlopen failed"));
  }
  Api a{};
  std::string missing;
  bool ok = true;
#define RESOLVE_NIXL(field) ok &= resolve(lib, "nixl_capi_" #field, &a.field, &missing)
  RESOLVE_NIXL(create_configured_agent);
  RESOLVE_NIXL(destroy_agent);
  RESOLVE_NIXL(get_plugin_params);
  RESOLVE_NIXL(destroy_mem_list);
  RESOLVE_NIXL(destroy_params);
  RESOLVE_NIXL(create_backend);
  RESOLVE_NIXL(destroy_backend);
  RESOLVE_NIXL(get_local_md);
  RESOLVE_NIXL(load_remote_md);
  RESOLVE_NIXL(invalidate_remote_md);
  RESOLVE_NIXL(create_reg_dlist);
  RESOLVE_NIXL(destroy_reg_dlist);
  RESOLVE_NIXL(reg_dlist_add_desc);
  RESOLVE_NIXL(register_mem);
  RESOLVE_NIXL(deregister_mem);
  RESOLVE_NIXL(create_xfer_dlist);
  RESOLVE_NIXL(destroy_xfer_dlist);
  RESOLVE_NIXL(xfer_dlist_add_desc);
  RESOLVE_NIXL(create_xfer_req);
  RESOLVE_NIXL(post_xfer_req);
  RESOLVE_NIXL(get_xfer_status);
  RESOLVE_NIXL(release_xfer_req);
  RESOLVE_NIXL(destroy_xfer_req);
  RESOLVE_NIXL(is_stub);
#undef RESOLVE_NIXL
  if (!ok) {
    // Kept loaded: unloading a library that started threads is unsafe. Remembered, not retried.
    g_failure = Status(Code::kNotFound, path + " lacks NIXL C API functions: " + missing);
    return g_failure;
  }
  if (a.is_stub()) {
    g_failure = Status(Code::kNotFound, path + " is NIXL's stub C API (built without NIXL)");
    return g_failure;
  }
  a.library = path;
  g_api = a;
  g_loaded = &g_api;
  *api = g_loaded;
  return Status::Ok();
}

std::string describe(int result) {
  const char* what = "unknown";
  switch (result) {
    case kSuccess: what = "success"; break;
    case kInProgress: what = "in progress"; break;
    case kInvalidParam: what = "invalid parameter"; break;
    case kBackend: what = "backend error"; break;
    case kInvalidState: what = "invalid state"; break;
    case kException: what = "exception"; break;
    case kNotFound: what = "not found"; break;
    default: break;
  }
  return "NIXL C API status " + std::to_string(result) + " (" + what + ")";
}

}  // namespace p2pw::nixl_capi
