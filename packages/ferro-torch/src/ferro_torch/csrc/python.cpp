// python.cpp: what backend "ferro" leaves to the group's Python backend (ProcessGroupFerro):
// monitored_barrier, sparse tensors, reductions of dtypes or ops the door lacks, all_to_all
// with sizes of each rank's own; the backend's lifetime around it; and the Python module (FerroBackend, made from the engine's capsule, and FerroProcessGroup,
// torch's group around it under the name "ferro").
//
// The GIL is taken only here, and only for those: the door's calls never need it.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <optional>

#include "ferro/engine_python.h"
#include "ferro_c10d.hpp"

namespace py = pybind11;

namespace ferro_torch {

struct PyState {
  py::object group;  // the ProcessGroupFerro of the same ranks and transport
};

namespace {

// the GIL let go while this lives, if this thread holds it (waiting for the worker, whose
// futures' callbacks may need it)
struct WithoutGil {
  PyThreadState* saved = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
  ~WithoutGil() {
    if (saved != nullptr) PyEval_RestoreThread(saved);
  }
};

// A collective on the Python backend, run to its end in this thread (synchronously, so that
// its door tickets are taken in issue order); a finished Work, or its error raised.
template <class Opts, class F>
WorkPtr in_python(FerroBackend& b, c10d::OpType type, std::vector<at::Tensor> outputs,
                  const Opts& opts, F&& call) {
  b.flush_deferred();  // (the group's collectives keep their order)
  Opts sync = opts;
  sync.asyncOp = false;
  {
    py::gil_scoped_acquire gil;
    py::object work = call(b.python().group, py::cast(sync));
    work.attr("wait")();
  }
  auto work = c10::make_intrusive<FerroWork>(type, std::move(outputs));
  work->complete();
  return b.noted(work);
}

}  // namespace

// ---------------------------------------------------------------------------- lifetime
FerroBackend::FerroBackend(ferro_comm* comm, int rank, int size, Ms timeout, bool inline_async,
                           size_t ring_bytes, std::unique_ptr<PyState> py)
    : c10d::Backend(rank, size),
      comm_(comm),
      api_(ferro_api(comm)),
      timeout_(timeout),
      inline_async_(inline_async),
      // (a message of one ring entry: at most a quarter of the ring, less its header)
      inline_send_(ring_bytes >= 256 ? std::min<size_t>(64 << 10, ring_bytes / 4 - 32) : 0),
      py_(std::move(py)) {
  open_backends().fetch_add(1);
  enroll(this, true);
}

FerroBackend::~FerroBackend() {
  enroll(this, false);
  uncount();
  {
    WithoutGil unlocked;
    stop_worker();
    if (p2p_->busy()) api_->close(comm_);  // a receive nobody will send to ends now
    p2p_->stop();
  }
  py_release();
  api_->release(comm_);
}

void FerroBackend::py_release() {
  if (!py_) return;
  if (!Py_IsInitialized()) {
    py_->group.release();
    return;
  }
  py::gil_scoped_acquire gil;
  py_.reset();
}

void FerroBackend::abandon(const std::string& why) const {
  py::gil_scoped_acquire gil;
  if (!py_) return;
  try {
    py_->group.attr("_abandon")(why);
  } catch (py::error_already_set& e) {  // the timeout is the error to raise
    e.discard_as_unraisable(__func__);
  }
}

void FerroBackend::shutdown() {
  {
    WithoutGil unlocked;
    stop_worker();  // every operation issued runs first
  }
  closed_ = true;
  uncount();
  {
    py::gil_scoped_acquire gil;
    py_->group.attr("shutdown")();  // (closes the transport the group owns)
  }
  WithoutGil unlocked;
  // point-to-point operations still pending (a receive nobody sends to) end now, with the
  // engine's "closed"; then their threads stop
  if (p2p_->busy()) api_->close(comm_);
  p2p_->stop();
}

void FerroBackend::abort() {
  api_->close(comm_);  // the calls in flight end now
  {
    WithoutGil unlocked;
    stop_worker();
    p2p_->stop();
  }
  closed_ = true;
  uncount();
  py::gil_scoped_acquire gil;
  py_->group.attr("abort")();
}

// ---------------------------------------------------------------------------- monitored barrier
void FerroBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  flush_deferred();
  py::gil_scoped_acquire gil;
  py::object timeout = opts.timeout.count() < 0 ? py::object(py::none())
                                                : py::object(py::float_(opts.timeout.count() / 1000.0));
  py_->group.attr("monitored_barrier")(timeout, wait_all_ranks);
}

// ---------------------------------------------------------------------------- deferred
// (here: the GIL is let go while they run, as torch lets it go for an issue or a wait)
void FerroBackend::run_deferred(const c10d::Work* upto) {
  WithoutGil unlocked;
  for (;;) {
    std::optional<Job> job;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (deferred_.empty()) return;
      if (upto != nullptr && std::none_of(deferred_.begin(), deferred_.end(), [&](const Job& j) {
            return j.work.get() == upto;
          }))
        return;  // (another thread runs it, or the worker does)
      job.emplace(std::move(deferred_.front()));
      deferred_.pop_front();
    }
    n_deferred_.fetch_sub(1, std::memory_order_acq_rel);
    deferred_anywhere().fetch_sub(1, std::memory_order_acq_rel);
    auto [work, error] = run_job(job);
    work->complete(error);  // (its future's callbacks run here)
    if (work.get() == upto) return;
  }
}

// ---------------------------------------------------------------------------- collectives
WorkPtr FerroBackend::py_allreduce(std::vector<at::Tensor>& tensors,
                                   const c10d::AllreduceOptions& opts) {
  return in_python(*this, c10d::OpType::ALLREDUCE, tensors, opts, [&](py::object& g, py::object o) {
    return g.attr("_allreduce")(tensors, o);
  });
}

WorkPtr FerroBackend::py_reduce(std::vector<at::Tensor>& tensors,
                                const c10d::ReduceOptions& opts) {
  return in_python(*this, c10d::OpType::REDUCE, tensors, opts, [&](py::object& g, py::object o) {
    return g.attr("reduce")(tensors, o);
  });
}

WorkPtr FerroBackend::py_reduce_scatter(std::vector<at::Tensor>& outputs,
                                        std::vector<std::vector<at::Tensor>>& inputs,
                                        const c10d::ReduceScatterOptions& opts) {
  return in_python(*this, c10d::OpType::REDUCE_SCATTER, outputs, opts,
                   [&](py::object& g, py::object o) {
                     return g.attr("reduce_scatter")(outputs, inputs, o);
                   });
}

WorkPtr FerroBackend::py_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                             const c10d::ReduceScatterOptions& opts) {
  return in_python(*this, c10d::OpType::_REDUCE_SCATTER_BASE, {output}, opts,
                   [&](py::object& g, py::object o) {
                     return g.attr("reduce_scatter_single")(output, input, o);
                   });
}

WorkPtr FerroBackend::py_alltoall_base(at::Tensor& output, at::Tensor& input,
                                       std::vector<int64_t>& output_splits,
                                       std::vector<int64_t>& input_splits,
                                       const c10d::AllToAllOptions& opts) {
  return in_python(*this, c10d::OpType::ALLTOALL_BASE, {output}, opts,
                   [&](py::object& g, py::object o) {
                     return g.attr("all_to_all_single")(output, input, output_splits,
                                                        input_splits, o);
                   });
}

WorkPtr FerroBackend::py_alltoall(std::vector<at::Tensor>& outputs,
                                  std::vector<at::Tensor>& inputs,
                                  const c10d::AllToAllOptions& opts) {
  return in_python(*this, c10d::OpType::ALLTOALL, outputs, opts,
                   [&](py::object& g, py::object o) {
                     return g.attr("alltoall")(outputs, inputs, o);
                   });
}

}  // namespace ferro_torch

// ---------------------------------------------------------------------------- the module
namespace {

using ferro_torch::FerroBackend;

// torch's ProcessGroup around a FerroBackend, named "ferro" (a group torch makes around a
// backend of a registered name says "custom" to getBackendName, DDP's logs among others)
class FerroProcessGroup : public c10d::ProcessGroup {
 public:
  using c10d::ProcessGroup::ProcessGroup;
  const std::string getBackendName() const override { return "ferro"; }
};

c10::intrusive_ptr<FerroBackend> make_backend(py::object capsule, py::object group, int rank,
                                              int size, double timeout, bool inline_async,
                                              size_t ring_bytes) {
  char why[512];
  ferro_comm* c = ferro_attach_capsule(capsule.ptr(), why, sizeof why);
  if (c == nullptr) throw std::runtime_error(why);
  const ferro_engine_api* api = ferro_api(c);
  if (api->rank(c) != rank || api->world_size(c) != size) {
    std::string msg = c10::str("FerroBackend: the engine's communicator is rank ", api->rank(c),
                               " of ", api->world_size(c), ", torch's group rank ", rank, " of ",
                               size);
    api->release(c);
    throw std::runtime_error(msg);
  }
  auto py = std::make_unique<ferro_torch::PyState>();
  py->group = std::move(group);
  return c10::make_intrusive<FerroBackend>(
      c, rank, size, ferro_torch::Ms(static_cast<int64_t>(timeout * 1000.0)), inline_async,
      ring_bytes, std::move(py));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch's c10d::Backend \"ferro\" on ferro's engine door (ferro/engine.h)";
  py::module_::import("torch.distributed");  // (c10d::Backend's Python type, our base)
  py::class_<FerroBackend, c10d::Backend, c10::intrusive_ptr<FerroBackend>>(m, "FerroBackend")
      .def(py::init(&make_backend), py::arg("capsule"), py::arg("python_group"),
           py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("inline_async"),
           py::arg("ring_bytes") = 0)
      .def_property_readonly("python_group",
                             [](FerroBackend& b) { return b.python().group; })
      .def_property_readonly("inline_async", &FerroBackend::inline_async)
      .def("__repr__", [](FerroBackend& b) {
        return c10::str("<ferro_torch FerroBackend rank=", b.getRank(), " size=", b.getSize(),
                        ">");
      });
  py::class_<FerroProcessGroup, c10d::ProcessGroup, c10::intrusive_ptr<FerroProcessGroup>>(
      m, "FerroProcessGroup")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size) {
             return c10::make_intrusive<FerroProcessGroup>(store, rank, size);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"));
  m.attr("DOOR_ABI") = py::make_tuple(FERRO_ENGINE_ABI_MAJOR, FERRO_ENGINE_ABI_MINOR);
}
