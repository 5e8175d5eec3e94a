// ferro_c10d.hpp: torch's c10d::Backend "ferro" on ferro's engine door (ferro/engine.h).
//
// FerroBackend runs a group's collectives as the door's calls on raw tensor memory, without
// Python and without the GIL: a synchronous call (asyncOp false) in the caller's thread, an
// asynchronous one on the backend's worker thread, or, where the host's ranks fill its cores
// (FERRO_BACKGROUND=auto, as the Python backend does), deferred: run in the thread that first
// waits for, polls or asks its Work's future, or issues the group's next collective; handed to
// the worker when a point-to-point operation is issued in the process (which its peer may need
// before it joins the collective, as on gloo) or its Work is waited for with a timeout. Every
// operation reserves its door tickets when it is issued, in issue order, so the door runs the
// calls of every thread (and ferro's own Python collectives on the same engine) in that order
// on every rank.
//
// Point-to-point messages run on the door's send and recv (p2p.cpp), on a pool of threads of
// their own. What the door cannot do (sparse tensors, a reduction of a dtype or op it lacks,
// uneven all_to_all, monitored_barrier) goes to the group's Python backend (ProcessGroupFerro,
// python.cpp), called with the GIL in the issuing thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <c10/util/SmallVector.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "ferro/engine.h"

namespace ferro_torch {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
using Ms = std::chrono::milliseconds;

// A new future of a list of tensors (what torch's Works complete with).
FuturePtr tensor_future();
// torch's error for a failure: c10::DistBackendError carrying `msg`.
std::exception_ptr backend_error(const std::string& msg);

// One operation of the backend: done in the caller's thread (complete() before it is
// returned) or on the worker. Its future is made when asked for.
class FerroWork : public c10d::Work {
 public:
  FerroWork(c10d::OpType type, std::vector<at::Tensor> outputs);
  // done (its future, if made, completed here: its callbacks run in this thread)
  void complete(std::exception_ptr error = nullptr);
  // done; its future, if one was made, returned for settle() to complete elsewhere
  FuturePtr finish(std::exception_ptr error);
  void settle(const FuturePtr& future);
  std::vector<at::Tensor> result() override;
  FuturePtr getFuture() override;

 protected:
  // c10d's wait, its timeout worded as ferro's (which call; that the work goes on)
  bool wait_worded(Ms timeout);

 private:
  std::vector<at::Tensor> outputs_;
  FuturePtr future_;
};

// The Works issued between torch's startCoalescing and endCoalescing, seen as one.
class CoalescedWork : public c10d::Work {
 public:
  explicit CoalescedWork(std::vector<WorkPtr> works);
  bool isCompleted() override;
  bool isSuccess() const override;
  bool wait(Ms timeout) override;
  std::vector<at::Tensor> result() override;
  FuturePtr getFuture() override;

 private:
  std::vector<WorkPtr> works_;
  std::mutex lock_;
  FuturePtr future_;
};

// The door tickets an operation reserved when it was issued, used in order; the ones it did
// not use (it failed before its last call) are given back when it ends.
class Tickets {
 public:
  Tickets(ferro_comm* c, const ferro_engine_api* api, size_t n);
  Tickets(Tickets&& other) noexcept;
  Tickets(const Tickets&) = delete;
  ~Tickets();
  int64_t next();

 private:
  ferro_comm* c_;
  const ferro_engine_api* api_;
  c10::SmallVector<int64_t, 4> tickets_;
  size_t used_ = 0;
};

// The threads that run point-to-point operations (p2p.cpp): a lane's operations one after
// another in the order they were posted, different lanes at once; a thread more whenever
// every thread is busy (a receive may wait for its message as long as its timeout).
//
// A thread that waits for an operation no pool thread has started runs it itself (run_here),
// with the operations posted before it in its lane: a synchronous dist.send / dist.recv costs
// no hand-over between threads. A small receive is parked when posted (no thread woken for
// it: its message waits in the ring whether or not a receive runs) until its Work is waited
// for, polled or asked for its future, another operation comes in its lane, or more than
// kMaxParked operations are parked; a lane with anything else starts at once.
class Lanes {
 public:
  // (0, destination, 0) for sends; (1, source or FERRO_ANY_SOURCE, tag) for receives
  using Key = std::tuple<int, int, int>;
  // one posted operation (its body is let go once it ran)
  struct Job {
    std::function<void()> body;
  };
  static constexpr size_t kMaxParked = 64;
  ~Lanes();
  // queue `body` in lane `key`; park: it may wait for run_here or start() (see above)
  std::shared_ptr<Job> post(Key key, std::function<void()> body, bool park = false);
  // run `job` (and what its lane holds before it) in this thread if no thread runs its lane
  // (true); else false (a pool thread runs it, or ran it)
  bool run_here(Key key, const std::shared_ptr<Job>& job);
  void start(Key key);  // a parked lane to the pool
  bool idle(Key key);   // nothing of the lane pending
  bool busy();          // something of any lane pending
  void stop();          // after what was posted has run (and what run_here runs has ended)

 private:
  struct Lane {
    std::deque<std::shared_ptr<Job>> jobs;
    bool queued = false;   // its key is in ready_
    bool running = false;  // a thread runs its operations
  };
  void run();
  // the next operation of ready_'s first lane (mu_ held by g; released meanwhile)
  void run_next(std::unique_lock<std::mutex>& g);
  // run the running lane's first operation with mu_ (held by g) released; it, done
  std::shared_ptr<Job> run_front(Lane& lane, std::unique_lock<std::mutex>& g);
  // (mu_ held) a lane neither queued nor running to ready_, and a thread woken for it
  void schedule(const Key& key, Lane& lane);
  // (mu_ held) after a lane's operation ended: its next one to ready_, or the lane forgotten
  void ended(const Key& key);

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable here_cv_;  // run_here's operations ending (stop waits for them)
  std::map<Key, Lane> lanes_;
  std::deque<Key> ready_;
  size_t idle_ = 0;
  size_t here_ = 0;    // lanes run_here runs now
  size_t parked_ = 0;  // operations in lanes neither queued nor running
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

// A point-to-point operation's Work: wait() with no timeout runs the operation in the waiting
// thread when no pool thread has started it; a wait with a timeout, a poll or its future
// starts a parked one on the pool; recv from any source says who sent.
class LaneWork : public FerroWork {
 public:
  using FerroWork::FerroWork;
  bool wait(Ms timeout = ::kNoTimeout) override;
  bool isCompleted() override;
  FuturePtr getFuture() override;
  int sourceRank() const override { return source_.load(); }
  void posted(std::weak_ptr<Lanes> lanes, Lanes::Key key, std::shared_ptr<Lanes::Job> job);
  std::atomic<int> source_{-1};

 private:
  std::mutex posted_mu_;
  std::weak_ptr<Lanes> lanes_;
  Lanes::Key key_;
  std::shared_ptr<Lanes::Job> job_;
  std::shared_ptr<Lanes> lanes(Lanes::Key* key, std::shared_ptr<Lanes::Job>* job);
};

// The Python side (python.cpp): the group's ProcessGroupFerro, for what stays on it.
struct PyState;

class FerroBackend : public c10d::Backend {
 public:
  // ring_bytes: the engine's point-to-point ring size (0: unknown; no send runs inline)
  FerroBackend(ferro_comm* comm, int rank, int size, Ms timeout, bool inline_async,
               size_t ring_bytes, std::unique_ptr<PyState> py);
  ~FerroBackend() override;

  const std::string getBackendName() const override { return "ferro"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsCoalescing() const override { return true; }
  void setTimeout(Ms timeout) override { timeout_ = timeout; }
  void startCoalescing() override;
  WorkPtr endCoalescing() override;
  void setSequenceNumberForGroup() override { seq_ = 0; }
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  void shutdown() override;  // (python.cpp: the Python group's too)
  void abort() override;

  // -- collectives on the door (backend.cpp, collectives.cpp)
  WorkPtr barrier(const c10d::BarrierOptions& opts) override;
  WorkPtr broadcast(std::vector<at::Tensor>& tensors,
                    const c10d::BroadcastOptions& opts) override;
  WorkPtr allreduce(std::vector<at::Tensor>& tensors,
                    const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& tensors,
                           const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceCoalescedOptions& opts) override;
  WorkPtr reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& outputs,
                    std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) override;
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input,
                          const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& output_lists,
                              std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllgatherOptions& opts) override;
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                 const c10d::GatherOptions& opts) override;
  WorkPtr scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                  const c10d::ScatterOptions& opts) override;
  WorkPtr reduce_scatter(std::vector<at::Tensor>& outputs,
                         std::vector<std::vector<at::Tensor>>& inputs,
                         const c10d::ReduceScatterOptions& opts) override;
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override;
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::ReduceScatterOptions& opts) override;
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input,
                        std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits,
                        const c10d::AllToAllOptions& opts) override;
  WorkPtr alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                   const c10d::AllToAllOptions& opts) override;

  // -- point-to-point on the door (p2p.cpp)
  WorkPtr send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  WorkPtr recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;

  // -- on the Python backend (python.cpp)
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  // what the Python backend runs for this group; a collective among them runs synchronously
  // in the issuing thread, so that its own door tickets keep the issue order
  WorkPtr py_allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts);
  WorkPtr py_reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts);
  WorkPtr py_reduce_scatter(std::vector<at::Tensor>& outputs,
                            std::vector<std::vector<at::Tensor>>& inputs,
                            const c10d::ReduceScatterOptions& opts);
  WorkPtr py_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                 const c10d::ReduceScatterOptions& opts);
  WorkPtr py_alltoall_base(at::Tensor& output, at::Tensor& input,
                           std::vector<int64_t>& output_splits,
                           std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts);
  WorkPtr py_alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                      const c10d::AllToAllOptions& opts);

  PyState& python() { return *py_; }
  bool inline_async() const { return inline_async_; }
  // The ferro backends of this process not shut down: an asynchronous operation runs in the
  // issuing call (inline_async_) only while its backend is the only one. With two groups a
  // rank may issue an async call on one, then a call on the other, while its peer does the
  // reverse: run at once, each waits for the other (gloo completes such a program).
  static std::atomic<int>& open_backends() {
    static std::atomic<int> open{0};
    return open;
  }
  void uncount() {
    if (counted_.exchange(false)) open_backends().fetch_sub(1);
  }
  // `work`, noted as part of the coalesced block torch has open, if any
  WorkPtr noted(WorkPtr work);

  // -- deferred asynchronous collectives (see the top)
  // run them in this thread, in issue order, up to and including `upto` (nullptr: all)
  void run_deferred(const c10d::Work* upto);
  // before another collective of this group: run them here (handed to the worker while
  // another ferro group is open, as an asynchronous call then goes there)
  void flush_deferred() {
    if (n_deferred_.load(std::memory_order_acquire) == 0) return;
    if (open_backends().load(std::memory_order_relaxed) == 1)
      run_deferred(nullptr);
    else
      hand_over();
  }
  // to the worker, in order (which it runs at once)
  void hand_over();
  // every backend's of this process: a point-to-point operation is issued
  static void hand_over_all();
  // the backends of this process hand_over_all reaches (add: one made; else: one ending)
  static void enroll(FerroBackend* b, bool add);
  // deferred collectives not yet run or handed over, in every backend of the process
  static std::atomic<int>& deferred_anywhere() {
    static std::atomic<int> n{0};
    return n;
  }

 private:
  using Body = std::function<void(Tickets&, double)>;
  struct Job {
    c10::intrusive_ptr<FerroWork> work;
    Tickets tickets;
    double seconds;
    Body body;
  };
  // Run `job`'s body (the worker's and a deferred one's): its Work and the error it raised;
  // the job let go (its unused tickets given back, its tensors released).
  static std::pair<c10::intrusive_ptr<FerroWork>, std::exception_ptr> run_job(
      std::optional<Job>& job) {
    std::exception_ptr error;
    try {
      job->body(job->tickets, job->seconds);
    } catch (...) {
      error = std::current_exception();
    }
    auto work = std::move(job->work);
    job.reset();
    return {std::move(work), error};
  }

  // Issue an operation of `calls` door calls: run body(tickets, seconds) now in this thread
  // (synchronous, or asynchronous where those run inline) or queue it for the worker.
  template <class F>
  WorkPtr issue(c10d::OpType type, bool async_op, Ms timeout, size_t calls,
                std::vector<at::Tensor> outputs, F&& body);
  // One door call: `call(opts)` with the operation's next ticket and its deadline; torch's
  // error if it fails.
  template <class F>
  void door(const char* name, Tickets& t, double secs, F&& call) const {
    ferro_opts o = FERRO_OPTS_INIT;
    o.timeout = secs;
    o.ticket = t.next();
    int rc = call(&o);
    if (rc != FERRO_OK) fail(name, rc, secs);
  }
  [[noreturn]] void fail(const char* name, int rc, double secs) const;
  // A collective this rank gave up on (its deadline passed): its messages are on their way,
  // and a late peer would take them for a live call; the Python group aborts the transport it
  // owns (the peers' calls then fail), as ferro_collective does (python.cpp).
  void abandon(const std::string& why) const;
  WorkPtr receive(std::vector<at::Tensor>& tensors, int src, int tag, c10d::OpType type);
  double seconds(Ms timeout) const;
  void loop();
  void callback_loop();
  void stop_worker();
  void py_release();

  // the worker to start if it was not (mu_ held)
  void start_worker();

  ferro_comm* comm_;
  const ferro_engine_api* api_;
  Ms timeout_;
  bool inline_async_;
  size_t inline_send_;  // a send up to this size is tried in the caller's thread (p2p.cpp)
  std::atomic<bool> counted_{true};
  std::unique_ptr<PyState> py_;
  std::atomic<uint64_t> seq_{0};
  bool closed_ = false;
  // coalescing (torch's startCoalescing .. endCoalescing)
  bool coalescing_ = false;
  std::vector<WorkPtr> coalesced_;
  // the worker
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::deque<Job> deferred_;  // (their tickets reserved at issue, after queue_'s)
  std::atomic<size_t> n_deferred_{0};
  bool stopping_ = false;
  std::thread worker_;
  // the futures of the worker's operations complete on a thread of their own (their
  // callbacks may issue an operation and wait for it, which the worker must be free to run)
  std::condition_variable callbacks_cv_;
  std::deque<std::pair<c10::intrusive_ptr<FerroWork>, FuturePtr>> callbacks_;
  std::thread callback_thread_;
  bool worker_done_ = false;
  // point-to-point operations (declared last: its threads stop first; shared with the
  // Works that may run one of them, which hold it weakly)
  std::shared_ptr<Lanes> p2p_ = std::make_shared<Lanes>();
};

// An asynchronous collective deferred (see the top): wait() with no timeout, isCompleted()
// and getFuture() run it (and the ones deferred before it) in this thread; wait() with a
// timeout hands them to the worker first.
class DeferredWork : public FerroWork {
 public:
  DeferredWork(c10d::OpType type, std::vector<at::Tensor> outputs,
               c10::weak_intrusive_ptr<FerroBackend> owner);
  bool wait(Ms timeout = ::kNoTimeout) override;
  bool isCompleted() override;
  FuturePtr getFuture() override;

 private:
  c10::weak_intrusive_ptr<FerroBackend> owner_;
};

template <class F>
WorkPtr FerroBackend::issue(c10d::OpType type, bool async_op, Ms timeout, size_t calls,
                            std::vector<at::Tensor> outputs, F&& body) {
  TORCH_CHECK(!closed_, "ferro: the process group was shut down");
  ++seq_;
  const double secs = seconds(timeout);
  flush_deferred();  // (the group's collectives keep their order)
  if (!async_op) {
    auto work = c10::make_intrusive<FerroWork>(type, std::move(outputs));
    {
      Tickets t(comm_, api_, calls);
      body(t, secs);  // (a synchronous call raises)
    }
    work->complete();
    return noted(work);
  }
  if (inline_async_ && open_backends().load(std::memory_order_relaxed) == 1) {
    auto work = c10::make_intrusive<DeferredWork>(
        type, std::move(outputs),
        c10::weak_intrusive_ptr<FerroBackend>(
            c10::intrusive_ptr<FerroBackend>::unsafe_reclaim_from_nonowning(this)));
    {
      std::lock_guard<std::mutex> g(mu_);
      deferred_.push_back(
          Job{work, Tickets(comm_, api_, calls), secs, Body(std::forward<F>(body))});
    }
    n_deferred_.fetch_add(1, std::memory_order_release);
    deferred_anywhere().fetch_add(1, std::memory_order_release);
    return noted(work);
  }
  auto work = c10::make_intrusive<FerroWork>(type, std::move(outputs));
  {
    // tickets reserved in the order operations enter the queue: the worker's order
    std::lock_guard<std::mutex> g(mu_);
    queue_.push_back(Job{work, Tickets(comm_, api_, calls), secs, Body(std::forward<F>(body))});
    start_worker();
  }
  cv_.notify_one();
  return noted(work);
}

// -- ferro/engine.h's names for torch's
// the door's dtype of a tensor's elements, -1 if it has none
int door_dtype(at::ScalarType t);
// the door's op for torch's `op` on `dtype`; -1 where the door lacks the pair (the Python
// backend decides); ValueError/TypeError in torch's words for ops no backend "ferro" has
int door_op(const c10d::ReduceOp& op, int dtype, const char* name);
// elements as the door moves them (data movement only): its dtype, else bytes
struct Items {
  int dtype;
  size_t count;
  const char* type_name;  // NULL: the dtype's
};
Items items_of(const at::Tensor& t);
void check_cpu(const char* name, const at::Tensor& t);
// a contiguous tensor of `t`'s elements: `t` itself, or a copy (copy back with write_back)
at::Tensor dense(const at::Tensor& t);
void write_back(const at::Tensor& t, const at::Tensor& buf);
// the tensors one after another in one contiguous block (the first one's memory), or undefined
at::Tensor span(const std::vector<at::Tensor>& ts);
// the lists' tensors, one after the other
std::vector<at::Tensor> joined(const std::vector<std::vector<at::Tensor>>& lists);

}  // namespace ferro_torch
