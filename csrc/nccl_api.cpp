// nccl_api.cpp — the NCCL function table (nccl_api.h) and what cuda_api.h
// says about the library it came from.
#include "nccl_api.h"

#include <dlfcn.h>
#include <link.h>

#include <stdexcept>
#include <string>

#include "cuda_api.h"

namespace pz {

namespace {

NcclApi g_api;  // filled once by nccl_open, read-only afterwards
bool g_open = false;
void* g_handle = nullptr;  // its dlopen handle, never closed

}  // namespace

const NcclApi& nccl() {
  if (!g_open)
    throw std::runtime_error("NCCL is not loaded: pyzero._C.nccl_open(path) was not called (import pyzero "
                             "does it, with the library pyzero._loader chose)");
  return g_api;
}

namespace cuda {

NcclLibrary nccl_open(const std::string& path) {
  if (g_open) {
    void* same = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);  // already loaded: which library
    if (same) dlclose(same);
    if (same == g_handle) return nccl_library();
    throw NcclLoadError("NCCL is already loaded from " + g_api.path + "; cannot switch to " + path +
                        " in the same process");
  }
  dlerror();
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    throw NcclLoadError(e ? e : path + ": cannot open");
  }
  NcclApi api;
  api.path = path;
  struct link_map* lm = nullptr;
  if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && *lm->l_name) api.path = lm->l_name;
  std::string missing;
#define PZ_NCCL_LOOKUP(name)                                                       \
  api.name = reinterpret_cast<decltype(api.name)>(dlsym(h, "nccl" #name));         \
  if (!api.name) missing += std::string(missing.empty() ? "" : ", ") + "nccl" #name;
  PZ_NCCL_FUNCTIONS(PZ_NCCL_LOOKUP)
#undef PZ_NCCL_LOOKUP
  if (!missing.empty()) {
    dlclose(h);
    std::string as = api.path == path ? "" : " (opened as " + path + ")";
    throw NcclLoadError("the NCCL library " + api.path + as + " lacks " + missing +
                        ", which pyzero calls: point PYZERO_NCCL_ROOT at a folder whose lib/libnccl.so.2 is a "
                        "complete NCCL, or unset it to use the nvidia-nccl-cu13 package");
  }
  api.test = dlsym(h, "pyzeroTestNccl") != nullptr;
  g_api = api;  // the handle stays open for the life of the process
  g_handle = h;
  g_open = true;
  return nccl_library();
}

NcclLibrary nccl_library() {
  NcclLibrary out;
  if (!g_open) return out;
  out.path = g_api.path;
  out.test = g_api.test;
  int v = 0;
  if (g_api.GetVersion(&v) == ncclSuccess) out.version = v;
  return out;
}

int nccl_version() { return nccl_library().version; }

}  // namespace cuda
}  // namespace pz
