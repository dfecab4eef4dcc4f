// bindings.cpp — the pybind11 module pyzero._C; the only file that includes
// pybind11, and glue only. Python hands over (data_ptr, count, dtype code, ...)
// already validated; C++ never sees a torch tensor. Every wait and every
// synchronous operation releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "cpu_optim.h"
#include "errors.h"
#include "flight.h"
#include "multi_tensor.h"
#include "ipc_protocol.h"
#include "ipc_transport.h"
#include "nccl_transport.h"
#include "p2p_ring.h"
#include "shm_comm.h"
#include "work.h"

#ifdef PYZERO_WITH_CUDA
#include "cuda_api.h"
#endif

namespace py = pybind11;
using namespace pz;

namespace {

// A Python-visible handle for in-flight work.
struct Work {
  std::shared_ptr<Task> task;
  void wait() {
    py::gil_scoped_release nogil;
    task->wait();
  }
  bool is_completed() { return task->completed(); }
  uint64_t flight_index() const { return task->flight_index; }
};

// Runs one ShmComm call: an async call returns its Work at once; a
// synchronous one runs without the GIL and returns None.
template <typename F>
py::object shm_call(bool async_op, F f) {
  if (async_op) return py::cast(Work{f()});
  {
    py::gil_scoped_release nogil;
    f();
  }
  return py::none();
}

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// One flight record as pyzero.flight reads it.
py::tuple flight_tuple(const FlightRecord& x) {
  return py::make_tuple(x.index, x.seq, x.call, x.count, x.dtype, x.op, x.algo, x.root, x.t0, x.t1, x.state);
}

// {name: code} for codes 0 .. n-1 of enum E, named by the C++ name table.
template <typename E, typename Name>
py::dict code_table(int n, Name name) {
  py::dict d;
  for (int i = 0; i < n; ++i) d[py::str(name(E(i)))] = i;
  return d;
}

#ifdef PYZERO_WITH_CUDA
// Runs one call of a GPU transport (NcclComm, IpcComm) without the GIL: None
// for a synchronous call, its Work (NcclWork, IpcWork) for an async one.
template <typename F>
py::object gpu_call(F f) {
  decltype(f()) w;
  {
    py::gil_scoped_release nogil;
    w = f();
  }
  if (!w) return py::none();
  return py::cast(w);
}
#endif

#ifdef PYZERO_WITH_CUDA
py::dict nccl_library_dict(const pz::cuda::NcclLibrary& lib) {
  py::dict d;
  d["path"] = lib.path;
  d["version"] = lib.version;
  d["test"] = lib.test;
  return d;
}
#endif

py::dict build_info() {
  py::dict d;
#ifdef PYZERO_WITH_CUDA
  d["cuda"] = true;
  int nccl_version = pz::cuda::nccl_version();  // of the library pyzero._loader opened
  d["nccl_version"] = nccl_version ? py::object(py::int_(nccl_version)) : py::object(py::none());
  d["cuda_runtime_version"] = pz::cuda::runtime_version();
  py::list archs;
  std::string a = PYZERO_CUDA_ARCHS;
  for (size_t pos = 0; pos <= a.size();) {
    size_t end = a.find(',', pos);
    if (end == std::string::npos) end = a.size();
    if (end > pos) archs.append(a.substr(pos, end - pos));
    pos = end + 1;
  }
  d["cuda_archs"] = archs;
#else
  d["cuda"] = false;
  d["nccl_version"] = py::none();
  d["cuda_runtime_version"] = py::none();
  d["cuda_archs"] = py::list();
#endif
#if defined(__clang__)
  d["compiler"] = std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  d["compiler"] = std::string("gcc ") + __VERSION__;
#else
  d["compiler"] = std::string("unknown");
#endif
#ifdef PYZERO_WITH_CUDA
  d["backends"] = py::make_tuple("shm", "nccl", "ipc");
#else
  d["backends"] = py::make_tuple("shm");
#endif
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pyzero core: ring collectives over shared memory (and CUDA kernels when built with nvcc)";

  static py::exception<CollectiveError> coll_err(m, "CollectiveError", PyExc_RuntimeError);
  static py::exception<CollectiveTimeout> coll_timeout(m, "CollectiveTimeout", coll_err.ptr());
  static py::exception<MessageMismatch> msg_mismatch(m, "MessageMismatch", coll_err.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CollectiveTimeout& e) {
      py::set_error(coll_timeout, e.what());
    } catch (const MessageMismatch& e) {
      py::set_error(msg_mismatch, e.what());
    } catch (const CollectiveError& e) {
      py::set_error(coll_err, e.what());
    }
  });

  // The integer codes every call takes, as the C++ enums define them.
  m.attr("DTYPES") = code_table<DType>(kNumDTypes, dtype_name);
  m.attr("OPS") = code_table<RedOp>(kNumRedOps, op_name);
  m.attr("ALGOS") = code_table<Algo>(kNumAlgos, algo_name);
  m.attr("COLLS") = code_table<Coll>(kNumColls, coll_name);
  m.attr("SYM_KINDS") = code_table<SymKind>(kNumSymKinds, sym_kind_name);

  m.def("build_info", &build_info, "How this extension was built: cuda, nccl_version, cuda_archs, compiler");

  py::class_<Work>(m, "Work")
      .def("wait", &Work::wait, "Block until the operation finished; raises its error, if any")
      .def("is_completed", &Work::is_completed)
      .def_property_readonly("flight_index", &Work::flight_index,
                             "The call's record in its group's flight ring (0: not recorded there)");

  // Flight rings (flight.h): written by C++ transports inside their calls,
  // and by pyzero.flight for the calls composed in Python.
  m.attr("FLIGHT_CALLS") = code_table<FlightCall>(kFlightCalls, flight_call_name);
  py::class_<FlightRing, std::shared_ptr<FlightRing>>(m, "FlightRing")
      .def(py::init<size_t, bool>(), py::arg("capacity"), py::arg("timed"))
      .def("begin", &FlightRing::begin, py::arg("call"), py::arg("count"), py::arg("dtype"), py::arg("op"),
           py::arg("algo"), py::arg("root"), py::arg("p2p"), py::arg("state") = int(kStarted))
      .def("finish", &FlightRing::finish)
      .def_property_readonly("n", &FlightRing::size)
      .def_property_readonly("capacity", &FlightRing::capacity)
      .def_property_readonly("timed", &FlightRing::timed)
      .def("records",  // [(index, seq, call, count, dtype, op, algo, root, t0_ns, t1_ns, state)], oldest first
           [](const FlightRing& r) {
             py::list out;
             for (const FlightRecord& x : r.records()) out.append(flight_tuple(x));
             return out;
           })
      .def("record", [](const FlightRing& r, uint64_t i) -> py::object {
        FlightRecord x;
        if (!r.read(i, x)) return py::none();
        return flight_tuple(x);
      });

  py::class_<OpStats>(m, "OpStats")
      .def_readonly("calls", &OpStats::calls)
      .def_readonly("elements", &OpStats::elements)
      .def_readonly("sent_bytes", &OpStats::sent_bytes);

  py::class_<AdaptTwoShot>(m, "AdaptTwoShot", "auto's ring/two-shot controller (shm_adapt.h), for tests")
      .def(py::init<>())
      .def_static("size_class", &AdaptTwoShot::size_class)
      .def_static("class_of", &AdaptTwoShot::class_of, py::arg("bytes"), py::arg("out_of_place"))
      .def("observe", &AdaptTwoShot::observe, py::arg("cls"), py::arg("twoshot"), py::arg("ns_per_byte"),
           py::arg("now_ns"), py::arg("call_end") = true)
      .def("want_twoshot", &AdaptTwoShot::want_twoshot)
      .def("want_long", &AdaptTwoShot::want_long)
      .def("switches", [](const AdaptTwoShot& a, int c) { return a.state(c).switches; })
      .def("explored", [](const AdaptTwoShot& a, int c) { return a.state(c).explored; })
      .def("tries_put_off", [](const AdaptTwoShot& a, int c) { return a.state(c).tries_put_off; })
      .def("stalled", [](const AdaptTwoShot& a, int c) { return a.state(c).stalled_tries; });

  py::class_<ShmComm>(m, "ShmComm")
      .def(py::init([](const std::string& prefix, int rank, int size, size_t slice_bytes, int depth,
                       size_t oneshot_bytes, double timeout_s, size_t stream_bytes, size_t twoshot_bytes,
                       bool adaptive, size_t twoshot_stream_bytes) {
             return std::make_unique<ShmComm>(prefix, rank, size,
                                              ShmConfig{slice_bytes, depth, oneshot_bytes, timeout_s, stream_bytes,
                                                        twoshot_bytes, adaptive, twoshot_stream_bytes});
           }),
           py::arg("prefix"), py::arg("rank"), py::arg("size"), py::arg("slice_bytes"), py::arg("depth"),
           py::arg("oneshot_bytes"), py::arg("timeout_s"), py::arg("stream_bytes") = ShmConfig{}.stream_bytes,
           py::arg("twoshot_bytes") = ShmConfig{}.twoshot_bytes, py::arg("adaptive") = ShmConfig{}.adaptive,
           py::arg("twoshot_stream_bytes") = ShmConfig{}.twoshot_stream_bytes)
      .def("adapt_state",
           [](ShmComm& c) {
             auto& t = c.transport();
             py::dict out;
             for (int k = 0; k < AdaptTwoShot::kClasses; ++k) {
               const auto& s = t.adapt().state(k);
               if (s.level[0] == 0.0 && s.level[1] == 0.0) continue;
               py::dict e;
               // the other algorithm: the one auto's size rule takes for the class (one-shot or ring)
               const size_t largest = AdaptTwoShot::largest_bytes(k);
               const char* other = t.choose_algo(Coll::all_reduce, largest) == Algo::oneshot ? "oneshot" : "ring";
               e["algo"] = s.twoshot ? "twoshot" : other;
               e["other"] = other;
               e["other_ns_per_byte"] = s.level[0];
               e["twoshot_ns_per_byte"] = s.level[1];
               e["switches"] = s.switches;
               e["explored"] = s.explored;
               e["put_off"] = s.tries_put_off;
               e["stalled"] = s.stalled_tries;
               e["mixed"] = s.mixed;
               e["long_pieces"] = s.long_pieces;
               e["mixed_long"] = s.mixed_long;
               out[py::make_tuple(largest, !AdaptTwoShot::out_of_place(k))] = e;
             }
             return out;
           },
           "{(largest bytes of a size class, in place): rank 0's state} of auto's choice between the two-shot and "
           "the one-shot or ring (empty on other ranks)")
      .def("probe_exchange", &ShmComm::probe_exchange, py::arg("bytes") = size_t(256) << 10, py::arg("reps") = 9,
           py::call_guard<py::gil_scoped_release>(),
           "ns per 64-byte line to read lines the ring predecessor has just written (median of reps; collective)")
      .def("set_flight", &ShmComm::set_flight, "Record every call in this flight ring (None: stop recording)")
      .def("attach", [](ShmComm& c) { c.transport().attach(); })
      .def("unlink", [](ShmComm& c) { c.transport().unlink(); })
      .def("close", &ShmComm::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("rank", [](ShmComm& c) { return c.transport().rank(); })
      .def_property_readonly("size", [](ShmComm& c) { return c.transport().size(); })
      .def("sym_create", [](ShmComm& c, size_t bytes) { c.transport().sym_create(bytes); })
      .def("sym_attach", [](ShmComm& c) { c.transport().sym_attach(); })
      .def("sym_unlink", [](ShmComm& c) { c.transport().sym_unlink(); })
      .def("sym_bytes", [](ShmComm& c) { return c.transport().sym_bytes(); })
      .def("sym_buffer",  // rank r's data: a writable memoryview (torch.frombuffer views it)
           [](ShmComm& c, int r) {
             ShmTransport& t = c.transport();
             if (r < 0 || r >= t.size()) throw py::value_error("rank: out of range");
             return py::memoryview::from_memory(t.sym_data(r), py::ssize_t(t.sym_bytes()), false);
           })
      .def("sym_arrive",
           [](ShmComm& c, int kind, int64_t count, int dt, std::vector<int64_t> dims) {
             py::gil_scoped_release nogil;
             c.sym_arrive(kind, count, DType(dt), std::move(dims));
           })
      .def("sym_signal", [](ShmComm& c, uint64_t v) { c.transport().sym_signal(v); })
      .def("sym_wait",
           [](ShmComm& c, int peer, uint64_t v, const std::string& what) {
             py::gil_scoped_release nogil;
             c.transport().sym_wait(peer, v, what.c_str());
           })
      .def("stats", [](ShmComm& c, bool reset) { return c.transport().stats(reset); }, py::arg("reset") = false)
      .def("all_reduce",
           [](ShmComm& c, uintptr_t buf, int64_t n, int dt, int op, int algo, bool async_op, uintptr_t in) {
             return shm_call(async_op, [&] {
               return c.all_reduce(as_ptr(buf), n, DType(dt), RedOp(op), Algo(algo), async_op, in ? as_ptr(in) : nullptr);
             });
           },
           py::arg("buf"), py::arg("n"), py::arg("dt"), py::arg("op"), py::arg("algo"), py::arg("async_op"),
           py::arg("in") = 0)
      .def("reduce_scatter",
           [](ShmComm& c, uintptr_t out, uintptr_t in, std::vector<int64_t> counts, int dt, int op, int algo,
              bool async_op) {
             return shm_call(async_op, [&] {
               return c.reduce_scatter(as_ptr(out), as_ptr(in), std::move(counts), DType(dt), RedOp(op), Algo(algo),
                                       async_op);
             });
           })
      .def("all_gather",
           [](ShmComm& c, uintptr_t out, uintptr_t in, std::vector<int64_t> counts, int dt, int algo,
              bool async_op) {
             return shm_call(async_op, [&] {
               return c.all_gather(as_ptr(out), as_ptr(in), std::move(counts), DType(dt), Algo(algo), async_op);
             });
           })
      .def("broadcast",
           [](ShmComm& c, uintptr_t buf, int64_t n, int dt, int root, int algo, bool async_op) {
             return shm_call(async_op,
                             [&] { return c.broadcast(as_ptr(buf), n, DType(dt), root, Algo(algo), async_op); });
           })
      .def("barrier", [](ShmComm& c, bool async_op) { return shm_call(async_op, [&] { return c.barrier(async_op); }); })
      .def("send",
           [](ShmComm& c, uintptr_t buf, int64_t n, int dt, int peer, bool async_op) {
             return shm_call(async_op, [&] { return c.send(as_ptr(buf), n, DType(dt), peer, async_op); });
           })
      .def("recv", [](ShmComm& c, uintptr_t buf, int64_t n, int dt, int peer, bool async_op) {
        return shm_call(async_op, [&] { return c.recv(as_ptr(buf), n, DType(dt), peer, async_op); });
      });

  // Multi-tensor pack/unpack (gradient buckets). Tables come as parallel lists
  // (pointer, numel, dtype code, offset in the flat buffer).
  auto slots = [](const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& numels,
                  const std::vector<int>& dtypes, const std::vector<int64_t>& offsets) {
    if (numels.size() != ptrs.size() || dtypes.size() != ptrs.size() || offsets.size() != ptrs.size())
      throw std::invalid_argument("multi_tensor: ptrs, numels, dtypes and offsets must have the same length");
    std::vector<TensorSlot> out(ptrs.size());
    for (size_t i = 0; i < ptrs.size(); ++i) out[i] = TensorSlot{as_ptr(ptrs[i]), numels[i], DType(dtypes[i]), offsets[i]};
    return out;
  };
  m.def(
      "multi_tensor_pack",
      [slots](std::vector<uintptr_t> ptrs, std::vector<int64_t> numels, std::vector<int> dtypes,
              std::vector<int64_t> offsets, uintptr_t flat, int flat_dtype, int64_t flat_numel, double scale) {
        auto table = slots(ptrs, numels, dtypes, offsets);
        py::gil_scoped_release nogil;
        multi_tensor_pack(table, as_ptr(flat), DType(flat_dtype), flat_numel, scale);
      },
      "flat[offset:offset+numel] = cast(scale * tensor) for every table row, in one pass (CPU pointers)");
  m.def(
      "multi_tensor_unpack",
      [slots](uintptr_t flat, int flat_dtype, int64_t flat_numel, std::vector<uintptr_t> ptrs,
              std::vector<int64_t> numels, std::vector<int> dtypes, std::vector<int64_t> offsets, double scale) {
        auto table = slots(ptrs, numels, dtypes, offsets);
        py::gil_scoped_release nogil;
        multi_tensor_unpack(as_ptr(flat), DType(flat_dtype), flat_numel, table, scale);
      },
      "tensor = cast(scale * flat[offset:offset+numel]) for every table row, in one pass (CPU pointers)");

  // Fused CPU optimizer steps. Tables come as parallel lists of pointers (0 for
  // none) and element counts; the scalars are already rounded to fp32 by Python.
  auto optim_slots = [](const std::vector<uintptr_t>& p, const std::vector<uintptr_t>& g,
                        const std::vector<uintptr_t>& s0, const std::vector<uintptr_t>& s1,
                        const std::vector<uintptr_t>& s2, const std::vector<uintptr_t>& copy,
                        const std::vector<int64_t>& n) {
    const size_t k = p.size();
    if (g.size() != k || s0.size() != k || s1.size() != k || s2.size() != k || copy.size() != k || n.size() != k)
      throw std::invalid_argument("cpu optimizer: every pointer list and numels must have the same length");
    std::vector<OptimSlot> out(k);
    for (size_t i = 0; i < k; ++i)
      out[i] = OptimSlot{static_cast<float*>(as_ptr(p[i])), static_cast<const float*>(as_ptr(g[i])),
                         static_cast<float*>(as_ptr(s0[i])), static_cast<float*>(as_ptr(s1[i])),
                         static_cast<float*>(as_ptr(s2[i])), as_ptr(copy[i]), n[i]};
    return out;
  };
  m.def("cpu_optim_isa", [] { return std::string(isa_name(best_isa())); },
        "The vector instruction set the CPU optimizers use here: avx512, avx2 or scalar");
  m.def("cpu_optim_threading", [] { return std::string(threading_name()); },
        "Where multi-threaded CPU optimizer steps run: 'openmp' (the process's OpenMP team, torch's) or "
        "'threads' (threads started per step: no OpenMP runtime loaded, or a forked child)");
  m.def(
      "cpu_bump_f32",
      [](uintptr_t ptr, int64_t n) {
        float* x = static_cast<float*>(as_ptr(ptr));
        std::vector<float> out(size_t(std::max<int64_t>(n, 0)));
        for (int64_t i = 0; i < n; ++i) out[size_t(i)] = x[i] += 1.0f;
        return out;
      },
      "x[i] += 1 for n float32s at a CPU pointer (an optimizer's step counts); returns the new values");
  m.def(
      "cpu_adam_step",
      [optim_slots](std::vector<uintptr_t> p, std::vector<uintptr_t> g, std::vector<uintptr_t> exp_avg,
                    std::vector<uintptr_t> exp_avg_sq, std::vector<uintptr_t> max_exp_avg_sq,
                    std::vector<uintptr_t> copy, std::vector<int64_t> numels, int copy_dtype, float grad_scale,
                    float weight_decay, float decay, float lerp_weight, float beta2, float one_minus_beta2,
                    float bias_correction2_sqrt, float eps, float neg_step_size, bool decoupled, bool amsgrad,
                    bool maximize, int threads, int isa, bool bf16_moments) {
        auto table = optim_slots(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, copy, numels);
        AdamScalars s{grad_scale, weight_decay, decay, lerp_weight, beta2, one_minus_beta2,
                      bias_correction2_sqrt, eps, neg_step_size, decoupled, amsgrad, maximize, bf16_moments};
        py::gil_scoped_release nogil;
        adam_step(table, s, DType(copy_dtype), threads, Isa(isa));
      },
      "One fused Adam/AdamW step over fp32 tensors, the moments fp32 or bf16 (CPU pointers); see "
      "csrc/cpu_optim.h");
  m.def(
      "cpu_adam_step_q8",
      [](std::vector<uintptr_t> p, std::vector<uintptr_t> g, std::vector<uintptr_t> m, std::vector<uintptr_t> m_absmax,
         std::vector<uintptr_t> v, std::vector<uintptr_t> v_absmax, std::vector<uintptr_t> copy,
         std::vector<int64_t> numels, int copy_dtype, float grad_scale, float weight_decay, float decay,
         float lerp_weight, float beta2, float one_minus_beta2, float bias_correction2_sqrt, float eps,
         float neg_step_size, bool decoupled, bool maximize, int threads, int isa) {
        const size_t k = p.size();
        if (g.size() != k || m.size() != k || m_absmax.size() != k || v.size() != k || v_absmax.size() != k ||
            copy.size() != k || numels.size() != k)
          throw std::invalid_argument("cpu optimizer: every pointer list and numels must have the same length");
        std::vector<Q8Slot> table(k);
        for (size_t i = 0; i < k; ++i)
          table[i] = Q8Slot{static_cast<float*>(as_ptr(p[i])), static_cast<const float*>(as_ptr(g[i])),
                            static_cast<int8_t*>(as_ptr(m[i])), static_cast<float*>(as_ptr(m_absmax[i])),
                            static_cast<uint8_t*>(as_ptr(v[i])), static_cast<float*>(as_ptr(v_absmax[i])),
                            as_ptr(copy[i]), numels[i]};
        AdamScalars s{grad_scale, weight_decay, decay, lerp_weight, beta2, one_minus_beta2,
                      bias_correction2_sqrt, eps, neg_step_size, decoupled, false, maximize, false};
        py::gil_scoped_release nogil;
        adam_step_q8(table, s, DType(copy_dtype), threads, Isa(isa));
      },
      "One fused Adam/AdamW step with 8-bit block-quantized moments (CPU pointers); see csrc/cpu_optim.h");
  m.def(
      "cpu_sgd_step",
      [optim_slots](std::vector<uintptr_t> p, std::vector<uintptr_t> g, std::vector<uintptr_t> momentum_buffer,
                    std::vector<uintptr_t> copy, std::vector<int64_t> numels, int copy_dtype, float grad_scale,
                    float weight_decay, float momentum, float one_minus_dampening, float neg_lr, bool nesterov,
                    bool maximize, bool first_step, int threads, int isa) {
        std::vector<uintptr_t> none(p.size(), 0);
        auto table = optim_slots(p, g, momentum_buffer, none, none, copy, numels);
        SgdScalars s{grad_scale, weight_decay, momentum, one_minus_dampening, neg_lr, nesterov, maximize, first_step};
        py::gil_scoped_release nogil;
        sgd_step(table, s, DType(copy_dtype), threads, Isa(isa));
      },
      "One fused SGD step over fp32 tensors (CPU pointers); see csrc/cpu_optim.h");
  m.def(
      "cpu_adagrad_step",
      [optim_slots](std::vector<uintptr_t> p, std::vector<uintptr_t> g, std::vector<uintptr_t> sum,
                    std::vector<uintptr_t> copy, std::vector<int64_t> numels, int copy_dtype, float grad_scale,
                    float weight_decay, float neg_clr, float eps, bool maximize, int threads, int isa) {
        std::vector<uintptr_t> none(p.size(), 0);
        auto table = optim_slots(p, g, sum, none, none, copy, numels);
        AdagradScalars s{grad_scale, weight_decay, neg_clr, eps, maximize};
        py::gil_scoped_release nogil;
        adagrad_step(table, s, DType(copy_dtype), threads, Isa(isa));
      },
      "One fused Adagrad step over fp32 tensors (CPU pointers); see csrc/cpu_optim.h");

#ifdef PYZERO_WITH_CUDA
  m.def(
      "cuda_reduce2",
      [](uintptr_t a, uintptr_t b, uintptr_t out, int64_t n, int dt, int op, int nranks, uintptr_t stream) {
        pz::cuda::launch_reduce2(as_ptr(a), as_ptr(b), as_ptr(out), n, DType(dt), RedOp(op), nranks, stream);
      },
      "out = a (+) b elementwise on the GPU (raw device pointers, dtype/op codes, cudaStream_t)");
  m.def("cuda_device_count", &pz::cuda::device_count);
  m.def("cuda_pointer_device", &pz::cuda::pointer_device, "CUDA device of a pointer, -1 for host memory");
  m.def("cuda_copy", [](uintptr_t src, uintptr_t dst, int64_t n, int dt, uintptr_t stream) {
    pz::cuda::launch_copy(as_ptr(src), as_ptr(dst), n, DType(dt), stream);
  });
  m.def("cuda_pack_wire", [](uintptr_t src, uintptr_t dst, int64_t n, int dt, uintptr_t stream) {
    pz::cuda::launch_pack_wire(as_ptr(src), as_ptr(dst), n, DType(dt), stream);
  });
  m.def("cuda_reduce_wire", [](uintptr_t in, uintptr_t own, uintptr_t out, int64_t n, int dt, int op,
                               uintptr_t stream) {
    pz::cuda::launch_reduce_wire(as_ptr(in), as_ptr(own), as_ptr(out), n, DType(dt), RedOp(op), stream);
  });
  m.def("cuda_reduce_wire_final", [](uintptr_t in, uintptr_t own, uintptr_t dst, int64_t n, int dt, int op, int nranks,
                                     uintptr_t stream) {
    pz::cuda::launch_reduce_wire_final(as_ptr(in), as_ptr(own), as_ptr(dst), n, DType(dt), RedOp(op), nranks, stream);
  });
  m.def("cuda_reduce_many", [](std::vector<uintptr_t> srcs, uintptr_t dst, int64_t n, int dt, int op, int nranks,
                               uintptr_t stream) {
    std::vector<const void*> p(srcs.size());
    for (size_t i = 0; i < srcs.size(); ++i) p[i] = as_ptr(srcs[i]);
    pz::cuda::launch_reduce_many(p.data(), int(p.size()), as_ptr(dst), n, DType(dt), RedOp(op), nranks, stream);
  }, "dst = srcs[0] (+) srcs[1] (+) ... in order (one-shot all-reduce kernel)");
  m.def("cuda_multi_tensor",
        [](std::vector<uintptr_t> ptrs, std::vector<int64_t> numels, std::vector<int64_t> offsets, int dt,
           uintptr_t flat, int flat_dt, bool to_flat, double scale, uintptr_t stream) {
          std::vector<void*> p(ptrs.size());
          for (size_t i = 0; i < ptrs.size(); ++i) p[i] = as_ptr(ptrs[i]);
          pz::cuda::launch_multi_tensor(p, numels, offsets, DType(dt), as_ptr(flat), DType(flat_dt), to_flat, scale,
                                        stream);
        },
        "Fused pack (to_flat) / unpack of many same-dtype device tensors and one flat device buffer");
  // csrc/nccl_api.h's [Note: the NCCL library is chosen at run time]
  m.def(
      "nccl_open",
      [](const std::string& path) {
        try {
          return nccl_library_dict(pz::cuda::nccl_open(path));
        } catch (const pz::cuda::NcclLoadError& e) {
          throw py::import_error(e.what());
        }
      },
      py::arg("path"),
      "Opens the NCCL library at `path` (RTLD_LOCAL) for every NCCL call _C makes; once per process. "
      "{'path', 'version', 'test'}; ImportError naming the library and any function it lacks");
  m.def(
      "nccl_library",
      [] {
        auto lib = pz::cuda::nccl_library();
        return lib.path.empty() ? py::object(py::none()) : py::object(nccl_library_dict(lib));
      },
      "The NCCL library nccl_open opened ({'path', 'version', 'test'}), or None");
  m.def("nccl_unique_id", [] { return py::bytes(NcclTransport::unique_id()); });

  py::class_<NcclWork, std::shared_ptr<NcclWork>>(m, "NcclWork")
      .def("wait", [](NcclWork& w, uintptr_t stream) { py::gil_scoped_release nogil; w.wait(stream); },
           py::arg("stream"), "Make `stream` wait for the operation (no host block); raises the group's failure")
      .def("is_completed", [](NcclWork& w) { py::gil_scoped_release nogil; return w.completed(); })
      .def_property_readonly("captured", &NcclWork::captured, "Issued into a CUDA graph capture")
      .def("synchronize", [](NcclWork& w) { py::gil_scoped_release nogil; w.synchronize(); },
           "Block the host until the operation finished");

  py::class_<NcclTransport>(m, "NcclComm")
      .def(py::init([](py::bytes uid, int rank, int size, int device, double timeout_s, size_t slice_bytes,
                       size_t oneshot_bytes, bool blocking_wait) {
             std::string id = uid;
             py::gil_scoped_release nogil;
             return std::make_unique<NcclTransport>(id, rank, size, device,
                                                    NcclConfig{timeout_s, slice_bytes, oneshot_bytes, blocking_wait});
           }),
           py::arg("unique_id"), py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("timeout_s"),
           py::arg("slice_bytes"), py::arg("oneshot_bytes"), py::arg("blocking_wait"))
      .def_property_readonly("rank", &NcclTransport::rank)
      .def_property_readonly("size", &NcclTransport::size)
      .def_property_readonly("device", &NcclTransport::device)
      .def_property_readonly("stream", &NcclTransport::stream)
      .def("set_timeout", &NcclTransport::set_timeout)
      .def("close", &NcclTransport::close, py::call_guard<py::gil_scoped_release>())
      .def("stats", &NcclTransport::stats, py::arg("reset") = false)
      .def("all_reduce", [](NcclTransport& t, uintptr_t buf, int64_t n, int dt, int op, int algo, uintptr_t stream,
                            bool async_op) {
        return gpu_call(
            [&] { return t.all_reduce(as_ptr(buf), n, DType(dt), RedOp(op), Algo(algo), stream, async_op); });
      })
      .def("reduce_scatter", [](NcclTransport& t, uintptr_t out, uintptr_t in, std::vector<int64_t> counts, int dt,
                                int op, int algo, uintptr_t stream, bool async_op) {
        return gpu_call([&] {
          return t.reduce_scatter(as_ptr(out), as_ptr(in), counts, DType(dt), RedOp(op), Algo(algo), stream, async_op);
        });
      })
      .def("all_gather", [](NcclTransport& t, uintptr_t out, uintptr_t in, std::vector<int64_t> counts, int dt,
                            int algo, uintptr_t stream, bool async_op) {
        return gpu_call(
            [&] { return t.all_gather(as_ptr(out), as_ptr(in), counts, DType(dt), Algo(algo), stream, async_op); });
      })
      .def("broadcast", [](NcclTransport& t, uintptr_t buf, int64_t n, int dt, int root, int algo, uintptr_t stream,
                           bool async_op) {
        return gpu_call([&] { return t.broadcast(as_ptr(buf), n, DType(dt), root, Algo(algo), stream, async_op); });
      })
      .def("barrier", [](NcclTransport& t, uintptr_t stream, bool async_op) {
        return gpu_call([&] { return t.barrier(stream, async_op); });
      })
      .def("send", [](NcclTransport& t, uintptr_t buf, int64_t n, int dt, int peer, uintptr_t stream, bool async_op) {
        return gpu_call([&] { return t.send(as_ptr(buf), n, DType(dt), peer, stream, async_op); });
      })
      .def("recv", [](NcclTransport& t, uintptr_t buf, int64_t n, int dt, int peer, uintptr_t stream, bool async_op) {
        return gpu_call([&] { return t.recv(as_ptr(buf), n, DType(dt), peer, stream, async_op); });
      })
      // ops: (buffer, count, dtype code, peer, is_send) each
      .def("batch_p2p", [](NcclTransport& t, const std::vector<std::tuple<uintptr_t, int64_t, int, int, bool>>& ops,
                           uintptr_t stream, bool async_op) {
        std::vector<NcclTransport::P2P> v;
        v.reserve(ops.size());
        for (const auto& [buf, n, dt, peer, is_send] : ops) v.push_back({as_ptr(buf), n, DType(dt), peer, is_send});
        return gpu_call([&] { return t.batch_p2p(v, stream, async_op); });
      });

  py::class_<IpcWork, std::shared_ptr<IpcWork>>(m, "IpcWork")
      .def("wait", [](IpcWork& w, uintptr_t stream) { py::gil_scoped_release nogil; w.wait(stream); },
           py::arg("stream"), "Make `stream` wait for the operation (no host block); raises a recorded failure")
      .def("is_completed", [](IpcWork& w) { py::gil_scoped_release nogil; return w.completed(); })
      .def_property_readonly("captured", &IpcWork::captured, "Issued into a CUDA graph capture")
      .def("synchronize", [](IpcWork& w) { py::gil_scoped_release nogil; w.synchronize(); },
           "Block the host until the operation finished");

  py::class_<IpcTransport>(m, "IpcComm")
      .def(py::init([](int rank, int size, int device, double timeout_s, uint64_t area_bytes, uint64_t oneshot_bytes,
                       uint64_t p2p_bytes, uint64_t p2p_slots, int sharing, bool system_scope, int blocks) {
             py::gil_scoped_release nogil;
             IpcConfig cfg{timeout_s, area_bytes, oneshot_bytes, p2p_bytes, p2p_slots, sharing};
             cfg.blocks = blocks;
             cfg.system_scope = system_scope;
             return std::make_unique<IpcTransport>(rank, size, device, cfg);
           }),
           py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("timeout_s"), py::arg("area_bytes"),
           py::arg("oneshot_bytes"), py::arg("p2p_bytes") = uint64_t(4) << 20, py::arg("p2p_slots") = 4,
           py::arg("sharing") = 1, py::arg("system_scope") = false, py::arg("blocks") = 0)
      .def("handle", [](IpcTransport& t) { return py::bytes(t.handle()); })
      .def("connect", [](IpcTransport& t, const std::vector<py::bytes>& hs) {
        std::vector<std::string> v(hs.begin(), hs.end());
        py::gil_scoped_release nogil;
        t.connect(v);
      })
      .def_property_readonly("rank", &IpcTransport::rank)
      .def_property_readonly("size", &IpcTransport::size)
      .def_property_readonly("device", &IpcTransport::device)
      .def_property_readonly("stream", &IpcTransport::stream)
      .def("set_timeout", &IpcTransport::set_timeout)
      .def("close", &IpcTransport::close, py::call_guard<py::gil_scoped_release>())
      .def("stats", &IpcTransport::stats, py::arg("reset") = false)
      .def("all_reduce", [](IpcTransport& t, uintptr_t buf, uintptr_t in, int64_t n, int dt, int op, int algo,
                            uintptr_t stream, bool async_op) {
        return gpu_call([&] {
          return t.all_reduce(as_ptr(buf), in ? as_ptr(in) : nullptr, n, DType(dt), RedOp(op), Algo(algo), stream,
                              async_op);
        });
      })
      .def("reduce_scatter", [](IpcTransport& t, uintptr_t out, uintptr_t in, std::vector<int64_t> counts, int dt,
                                int op, int algo, uintptr_t stream, bool async_op) {
        return gpu_call([&] {
          return t.reduce_scatter(as_ptr(out), as_ptr(in), counts, DType(dt), RedOp(op), Algo(algo), stream, async_op);
        });
      })
      .def("all_gather", [](IpcTransport& t, uintptr_t out, uintptr_t in, std::vector<int64_t> counts, int dt,
                            int algo, uintptr_t stream, bool async_op) {
        return gpu_call(
            [&] { return t.all_gather(as_ptr(out), as_ptr(in), counts, DType(dt), Algo(algo), stream, async_op); });
      })
      .def("broadcast", [](IpcTransport& t, uintptr_t buf, int64_t n, int dt, int root, int algo, uintptr_t stream,
                           bool async_op) {
        return gpu_call([&] { return t.broadcast(as_ptr(buf), n, DType(dt), root, Algo(algo), stream, async_op); });
      })
      .def("barrier", [](IpcTransport& t, uintptr_t stream, bool async_op, bool closing) {
        return gpu_call([&] { return t.barrier(stream, async_op, closing); });
      }, py::arg("stream"), py::arg("async_op"), py::arg("closing") = false)
      .def("send", [](IpcTransport& t, uintptr_t buf, int64_t n, int dt, int peer, uintptr_t stream, bool async_op) {
        return gpu_call([&] { return t.send(as_ptr(buf), n, DType(dt), peer, stream, async_op); });
      })
      .def("recv", [](IpcTransport& t, uintptr_t buf, int64_t n, int dt, int peer, uintptr_t stream, bool async_op) {
        return gpu_call([&] { return t.recv(as_ptr(buf), n, DType(dt), peer, stream, async_op); });
      })
      // ops: (buffer, count, dtype code, peer, is_send) each
      .def("batch_p2p", [](IpcTransport& t, const std::vector<std::tuple<uintptr_t, int64_t, int, int, bool>>& ops,
                           uintptr_t stream, bool async_op) {
        std::vector<IpcTransport::P2P> v;
        v.reserve(ops.size());
        for (const auto& [buf, n, dt, peer, is_send] : ops) v.push_back({as_ptr(buf), n, DType(dt), peer, is_send});
        return gpu_call([&] { return t.batch_p2p(v, stream, async_op); });
      });
#endif

  // Host-side logic of the CUDA backends, available in every build (tested without a GPU).
  m.def("nccl_resolve_algo", [](int coll, size_t bytes, int algo, size_t oneshot_bytes, int nranks) {
    if (coll < 0 || coll >= kNumColls) throw std::invalid_argument("coll: unknown collective code");
    return int(nccl_resolve_algo(Coll(coll), bytes, Algo(algo), oneshot_bytes, nranks));
  }, py::arg("coll"), py::arg("bytes"), py::arg("algo"), py::arg("oneshot_bytes"), py::arg("nranks"),
     "The algorithm the nccl backend runs for a call (see csrc/nccl_transport.h)");
  m.def("ipc_resolve_algo", [](int coll, size_t bytes, int algo, size_t oneshot_bytes, int nranks) {
    if (coll < 0 || coll >= kNumColls) throw std::invalid_argument("coll: unknown collective code");
    return int(ipc_resolve_algo(Coll(coll), bytes, Algo(algo), oneshot_bytes, nranks));
  }, py::arg("coll"), py::arg("bytes"), py::arg("algo"), py::arg("oneshot_bytes"), py::arg("nranks"),
     "The algorithm the ipc backend runs for a call (see csrc/ipc_transport.h)");
  m.def("ipc_blocks", &ipc_blocks, py::arg("sms"), py::arg("sharing"),
        "Blocks of every ipc kernel on a GPU of `sms` SMs shared by `sharing` processes (csrc/ipc_protocol.h)");
  m.def("p2p_ring_plan", [](int coll, std::vector<int64_t> counts, int rank, int nranks, int dt, int root,
                            size_t stage_bytes, bool in_is_chunk) {
    if (coll < 0 || coll >= kNumColls) throw std::invalid_argument("coll: unknown collective code");
    return p2p_ring_plan(Coll(coll), counts, rank, nranks, DType(dt), root, stage_bytes, in_is_chunk);
  }, py::arg("coll"), py::arg("counts"), py::arg("rank"), py::arg("nranks"), py::arg("dtype"), py::arg("root"),
     py::arg("stage_bytes"), py::arg("in_is_chunk") = false,
     "The ops the NCCL ring issues on one rank, as lists of ints (see csrc/p2p_ring.h PlanExec)");
}
