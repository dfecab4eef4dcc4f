// nccl_api.h — the NCCL functions _C calls, as a table of pointers filled
// from one library that _C opens itself. Types and constants come from nccl.h
// (compile time only); _C does not link libnccl.so.2.
//
// [Note: the NCCL library is chosen at run time]
// pyzero._loader decides which libnccl.so.2 to use ($PYZERO_NCCL_ROOT/lib,
// else one already in the process, e.g. torch's, else the nvidia-nccl-cu13
// package, else the system loader) and, right after importing _C, calls
// _C.nccl_open(path). nccl_open dlopens it (RTLD_NOW | RTLD_LOCAL) and fills
// the table with dlsym on that handle, so every call below goes to that
// library even when another libnccl.so.2 sits in the global scope (torch's
// NCCL, imported first): a test NCCL with the same API and SONAME (several
// ranks per GPU) can be used beside a CUDA torch. Opening at import, not at
// first use: a missing library or symbol is reported by `import pyzero`,
// before any process group is made, naming the library and the symbol; and
// the table never changes afterwards, so calls read it without a lock.
// What the library itself calls is its own business: a library loaded beside
// another libnccl.so.2 binds its internal calls to its own functions only if
// it was linked that way (-Bsymbolic, or internal calls to hidden functions).
// nccl() throws until nccl_open succeeded (an _C imported without pyzero).
#pragma once

#include <nccl.h>

#include <string>

namespace pz {

// X(name): the NCCL function nccl##name, a member `name` of NcclApi.
#define PZ_NCCL_FUNCTIONS(X) \
  X(GetVersion)              \
  X(GetUniqueId)             \
  X(CommInitRankConfig)      \
  X(CommAbort)               \
  X(CommDestroy)             \
  X(CommFinalize)            \
  X(CommGetAsyncError)       \
  X(GetErrorString)          \
  X(GetLastError)            \
  X(GroupStart)              \
  X(GroupEnd)                \
  X(Send)                    \
  X(Recv)                    \
  X(AllReduce)               \
  X(Broadcast)               \
  X(Reduce)                  \
  X(AllGather)               \
  X(ReduceScatter)

struct NcclApi {
#define PZ_NCCL_MEMBER(name) decltype(&::nccl##name) name = nullptr;
  PZ_NCCL_FUNCTIONS(PZ_NCCL_MEMBER)
#undef PZ_NCCL_MEMBER
  std::string path;   // the file the functions were found in
  bool test = false;  // the library exports pyzeroTestNccl: pyzero's test NCCL (ranks may share a GPU)
};

// The opened table: nccl().AllReduce(...). Throws std::runtime_error before nccl_open.
const NcclApi& nccl();

}  // namespace pz
