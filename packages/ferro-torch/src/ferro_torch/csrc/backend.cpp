// backend.cpp: FerroBackend's life (worker, coalescing, errors) and the collectives that
// reduce or broadcast tensors in place: barrier, broadcast, allreduce, reduce.
#include "ferro_c10d.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

namespace ferro_torch {

using c10d::OpType;

c10::intrusive_ptr<c10d::Backend::Options> FerroBackend::getBackendOptions() {
  return c10::make_intrusive<Options>("ferro", timeout_);
}

double FerroBackend::seconds(Ms timeout) const {
  return (timeout.count() > 0 ? timeout : timeout_).count() / 1000.0;
}

void FerroBackend::fail(const char* name, int rc, double secs) const {
  std::string detail = c10::str(api_->status_name(rc), ": ", api_->last_error());
  if (rc == FERRO_TIMEOUT && std::strcmp(name, "send") != 0 && std::strcmp(name, "recv") != 0)
    abandon(c10::str(name, ": ", detail));
  if (rc == FERRO_TIMEOUT)  // as torch's backends word it, the door's detail after
    C10_THROW_ERROR(DistBackendError,
                    c10::str("ferro ", name, ": Timed out waiting ", std::llround(secs * 1000),
                             "ms for the operation to complete (", detail, ")"));
  C10_THROW_ERROR(DistBackendError, c10::str("ferro ", name, ": ", detail));
}

// ---------------------------------------------------------------------------- the worker
void FerroBackend::loop() {
  for (;;) {
    std::optional<Job> job;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and every operation ran
      job.emplace(std::move(queue_.front()));
      queue_.pop_front();
    }
    auto [work, error] = run_job(job);
    FuturePtr f = work->finish(error);
    if (!f) continue;
    {
      std::lock_guard<std::mutex> g(mu_);
      callbacks_.emplace_back(std::move(work), std::move(f));
      if (!callback_thread_.joinable())
        callback_thread_ = std::thread([this] { callback_loop(); });
    }
    callbacks_cv_.notify_one();
  }
}

void FerroBackend::callback_loop() {
  for (;;) {
    std::pair<c10::intrusive_ptr<FerroWork>, FuturePtr> item;
    {
      std::unique_lock<std::mutex> g(mu_);
      callbacks_cv_.wait(g, [this] { return !callbacks_.empty() || worker_done_; });
      if (callbacks_.empty()) return;
      item = std::move(callbacks_.front());
      callbacks_.pop_front();
    }
    item.first->settle(item.second);
  }
}

void FerroBackend::start_worker() {
  if (!worker_.joinable() && !worker_done_) worker_ = std::thread([this] { loop(); });
}

void FerroBackend::hand_over() {
  size_t n;
  {
    std::lock_guard<std::mutex> g(mu_);
    n = deferred_.size();
    if (n == 0) return;
    for (auto& job : deferred_) queue_.push_back(std::move(job));  // (tickets in order)
    deferred_.clear();
    start_worker();
  }
  n_deferred_.fetch_sub(n, std::memory_order_acq_rel);
  deferred_anywhere().fetch_sub(static_cast<int>(n), std::memory_order_acq_rel);
  cv_.notify_one();
}

namespace {
std::mutex enrolled_mu;
std::vector<FerroBackend*>& enrolled() {
  static std::vector<FerroBackend*> backends;
  return backends;
}
}  // namespace

void FerroBackend::enroll(FerroBackend* b, bool add) {
  std::lock_guard<std::mutex> g(enrolled_mu);
  auto& v = enrolled();
  if (add)
    v.push_back(b);
  else
    v.erase(std::remove(v.begin(), v.end(), b), v.end());
}

void FerroBackend::hand_over_all() {
  std::lock_guard<std::mutex> g(enrolled_mu);  // (a backend leaves it first as it ends)
  for (FerroBackend* b : enrolled()) b->hand_over();
}

void FerroBackend::stop_worker() {
  hand_over();  // (what was deferred runs first, on the worker)
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  const auto me = std::this_thread::get_id();
  if (worker_.joinable()) {  // (it runs what is queued first)
    if (worker_.get_id() == me)
      worker_.detach();
    else
      worker_.join();
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    worker_done_ = true;
  }
  callbacks_cv_.notify_all();
  if (callback_thread_.joinable()) {
    if (callback_thread_.get_id() == me)
      callback_thread_.detach();
    else
      callback_thread_.join();
  }
}

// ---------------------------------------------------------------------------- coalescing
WorkPtr FerroBackend::noted(WorkPtr work) {
  if (coalescing_) coalesced_.push_back(work);
  return work;
}

void FerroBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "ferro startCoalescing: this group is already coalescing");
  coalescing_ = true;
  coalesced_.clear();
}

WorkPtr FerroBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "ferro endCoalescing: this group is not coalescing");
  coalescing_ = false;
  return c10::make_intrusive<CoalescedWork>(std::move(coalesced_));
}

// ---------------------------------------------------------------------------- collectives
WorkPtr FerroBackend::barrier(const c10d::BarrierOptions& opts) {
  return issue(OpType::BARRIER, opts.asyncOp, opts.timeout, 1, {},
               [this](Tickets& t, double secs) {
                 door("barrier", t, secs, [&](const ferro_opts* o) {
                   return api_->barrier(comm_, o);
                 });
               });
}

WorkPtr FerroBackend::broadcast(std::vector<at::Tensor>& tensors,
                                const c10d::BroadcastOptions& opts) {
  for (auto& t : tensors) check_cpu("broadcast", t);
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of ",
                    size_);
  return issue(OpType::BROADCAST, opts.asyncOp, opts.timeout, tensors.size(), tensors,
               [this, tensors, root](Tickets& t, double secs) {
                 for (auto& x : tensors) {
                   at::Tensor buf = dense(x);
                   Items it = items_of(buf);
                   void* p = buf.data_ptr();
                   door("broadcast", t, secs, [&](ferro_opts* o) {
                     o->type_name = it.type_name;
                     return api_->broadcast(comm_, rank_ == root ? p : nullptr, p, it.count,
                                            it.dtype, root, o);
                   });
                   write_back(x, buf);
                 }
               });
}

WorkPtr FerroBackend::allreduce(std::vector<at::Tensor>& tensors,
                                const c10d::AllreduceOptions& opts) {
  for (auto& t : tensors) {
    if (t.defined() && t.layout() != at::kStrided) return py_allreduce(tensors, opts);
    check_cpu("allreduce", t);
    // a dtype or op the door lacks: the Python backend (which says if it cannot either)
    if (door_op(opts.reduceOp, door_dtype(t.scalar_type()), "allreduce") < 0)
      return py_allreduce(tensors, opts);
  }
  return issue(OpType::ALLREDUCE, opts.asyncOp, opts.timeout, tensors.size(), tensors,
               [this, tensors, rop = opts.reduceOp](Tickets& t, double secs) {
                 for (auto& x : tensors) {
                   const int dt = door_dtype(x.scalar_type());
                   const int op = door_op(rop, dt, "allreduce");
                   at::Tensor buf = dense(x);
                   void* p = buf.data_ptr();
                   door("allreduce", t, secs, [&](const ferro_opts* o) {
                     return api_->allreduce(comm_, p, p, buf.numel(), dt, op, o);
                   });
                   write_back(x, buf);
                 }
               });
}

WorkPtr FerroBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                       const c10d::AllreduceOptions& opts) {
  return py_allreduce(tensors, opts);
}

WorkPtr FerroBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                          const c10d::AllreduceCoalescedOptions& opts) {
  return allreduce(tensors, opts);
}

WorkPtr FerroBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  const int root = static_cast<int>(opts.rootRank);
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "reduce: root ", root, " is not a rank of ",
                    size_);
  for (auto& t : tensors) {
    check_cpu("reduce", t);
    if (door_op(opts.reduceOp, door_dtype(t.scalar_type()), "reduce") < 0)
      return py_reduce(tensors, opts);
  }
  return issue(OpType::REDUCE, opts.asyncOp, opts.timeout, tensors.size(), tensors,
               [this, tensors, root, rop = opts.reduceOp](Tickets& t, double secs) {
                 for (auto& x : tensors) {
                   const int dt = door_dtype(x.scalar_type());
                   const int op = door_op(rop, dt, "reduce");
                   at::Tensor buf = dense(x);
                   void* p = buf.data_ptr();
                   door("reduce", t, secs, [&](const ferro_opts* o) {
                     return api_->reduce(comm_, p, rank_ == root ? p : nullptr, buf.numel(), dt,
                                         op, root, o);
                   });
                   if (rank_ == root) write_back(x, buf);
                 }
               });
}

}  // namespace ferro_torch
