// p2p.cpp: torch's send, recv and recv from any source on the door's point-to-point calls,
// without Python and without the GIL.
//
// The door's send returns once the message is in the peer's ring (a large one waits for the
// peer to take its pieces); its recv waits for the message. torch's isend/irecv must return
// at once, so a message runs on a thread of the group's point-to-point pool (Lanes): one lane
// per destination for sends, per (source, tag) for receives (per tag for any source), each
// lane's operations in issue order, different lanes at once (a receive that waits never holds
// up another tag's or another peer's). A small send to a destination with nothing pending is
// tried in the caller's thread: it only writes into the ring if there is room (a finished
// Work), and goes to the pool if there is none.
// A Work waited for with no timeout before any pool thread took its operation (a synchronous
// dist.recv or dist.send, batch_isend_irecv's waits) runs it in the waiting thread, and a
// small receive is parked until then (Lanes): no thread wakes another for it. The pool still
// runs every other operation at once, so a rank that receives while it sends never waits for
// itself.
#include "ferro_c10d.hpp"

#include <algorithm>
#include <cctype>

namespace ferro_torch {

namespace {

// messages up to this size (and within a quarter of the ring: one entry) are tried in the
// caller's thread when their lane is idle: a door send whose deadline has passed, which puts
// the message if the ring has room for it and otherwise gives up without writing it (then the
// pool sends it, waiting for room as long as its timeout: a peer that posts its receives after
// its own sends has not read the ring yet, and would never read it while this thread waited)
constexpr size_t kInlineSend = 64 << 10;
// that deadline (0 is "the default timeout"): the door gives up within two of the kernel's
// coarse clock ticks (under 8 ms) when there is no room
constexpr double kTrySend = 1e-9;

void check_message(const char* name, const std::vector<at::Tensor>& tensors, int peer,
                   int size, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, name, ": ", tensors.size(), " tensors, expected 1");
  check_cpu(name, tensors[0]);
  TORCH_CHECK_VALUE(peer >= 0 && peer < size, name, ": rank ", peer, " is not a rank of ", size);
  TORCH_CHECK_VALUE(tag >= 0, name, ": tag ", tag, " is negative");
}

size_t bytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

}  // namespace

// ---------------------------------------------------------------------------- Lanes
Lanes::~Lanes() { stop(); }

std::shared_ptr<Lanes::Job> Lanes::post(Key key, std::function<void()> body, bool park) {
  auto job = std::make_shared<Job>(Job{std::move(body)});
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(!stopping_, "ferro: the process group was shut down");
  Lane& lane = lanes_[key];
  lane.jobs.push_back(job);
  if (lane.running || lane.queued) return job;  // taken after the ones before it
  if (park && lane.jobs.size() == 1 && parked_ < kMaxParked) {
    ++parked_;
    return job;
  }
  parked_ -= lane.jobs.size() - 1;  // (what the lane held was parked)
  schedule(key, lane);
  return job;
}

void Lanes::schedule(const Key& key, Lane& lane) {
  lane.queued = true;
  ready_.push_back(key);
  if (ready_.size() > idle_ && !stopping_)  // every thread is busy: one more
    threads_.emplace_back([this] { run(); });
  else
    cv_.notify_one();
}

void Lanes::start(Key key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = lanes_.find(key);
  if (it == lanes_.end() || it->second.running || it->second.queued) return;
  parked_ -= it->second.jobs.size();
  schedule(key, it->second);
}

bool Lanes::run_here(Key key, const std::shared_ptr<Job>& job) {
  std::unique_lock<std::mutex> g(mu_);
  if (stopping_) return false;  // (stop runs it)
  auto it = lanes_.find(key);
  if (it == lanes_.end() || it->second.running) return false;
  Lane& lane = it->second;
  if (std::find(lane.jobs.begin(), lane.jobs.end(), job) == lane.jobs.end()) return false;
  if (lane.queued) {  // a thread was woken for it, and has not taken it
    lane.queued = false;
    ready_.erase(std::find(ready_.begin(), ready_.end(), key));
  } else {
    parked_ -= lane.jobs.size();
  }
  lane.running = true;
  ++here_;
  while (run_front(lane, g) != job) {
  }  // (the lane's operations up to `job`, in order)
  ended(key);
  --here_;
  g.unlock();
  here_cv_.notify_all();
  return true;
}

void Lanes::ended(const Key& key) {
  Lane& lane = lanes_[key];  // (the map may have grown meanwhile; nodes stay put)
  lane.running = false;
  if (lane.jobs.empty())
    lanes_.erase(key);
  else
    schedule(key, lane);  // behind the other lanes waiting
}

void Lanes::run_next(std::unique_lock<std::mutex>& g) {
  Key key = ready_.front();
  ready_.pop_front();
  Lane& lane = lanes_[key];
  lane.queued = false;
  lane.running = true;
  run_front(lane, g);
  ended(key);
}

std::shared_ptr<Lanes::Job> Lanes::run_front(Lane& lane, std::unique_lock<std::mutex>& g) {
  std::shared_ptr<Job> job = std::move(lane.jobs.front());
  lane.jobs.pop_front();
  g.unlock();  // (a running lane is not erased: `lane` stays)
  job->body();  // (completes its Work: never throws)
  job->body = nullptr;
  g.lock();
  return job;
}

bool Lanes::idle(Key key) {
  std::lock_guard<std::mutex> g(mu_);
  return lanes_.find(key) == lanes_.end();
}

void Lanes::run() {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(g, [this] { return stopping_ || !ready_.empty(); });
    --idle_;
    if (ready_.empty()) return;  // stopping, and nothing left to run
    run_next(g);
  }
}

bool Lanes::busy() {
  std::lock_guard<std::mutex> g(mu_);
  return !lanes_.empty();
}

void Lanes::stop() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
    for (auto& [key, lane] : lanes_)  // the parked lanes run too
      if (!lane.running && !lane.queued) schedule(key, lane);
    parked_ = 0;
    threads.swap(threads_);
  }
  cv_.notify_all();
  const auto me = std::this_thread::get_id();
  for (auto& t : threads) {
    if (t.get_id() == me)
      t.detach();  // (a Work's callback shut the group down)
    else
      t.join();
  }
  // what is left runs here: lanes queued with no thread to take them (none starts once
  // stopping), and the next operations of a lane run_here ran, which may end after the threads
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    if (!ready_.empty())
      run_next(g);
    else if (here_ == 0)
      return;
    else
      here_cv_.wait(g);
  }
}

// ---------------------------------------------------------------------------- LaneWork
void LaneWork::posted(std::weak_ptr<Lanes> lanes, Lanes::Key key,
                      std::shared_ptr<Lanes::Job> job) {
  std::lock_guard<std::mutex> g(posted_mu_);
  lanes_ = std::move(lanes);
  key_ = key;
  job_ = std::move(job);
}

std::shared_ptr<Lanes> LaneWork::lanes(Lanes::Key* key, std::shared_ptr<Lanes::Job>* job) {
  std::lock_guard<std::mutex> g(posted_mu_);
  *key = key_;
  *job = job_;
  return job_ ? lanes_.lock() : nullptr;
}

bool LaneWork::wait(Ms timeout) {
  if (!FerroWork::isCompleted()) {
    Lanes::Key key;
    std::shared_ptr<Lanes::Job> job;
    if (auto lanes = this->lanes(&key, &job)) {
      if (timeout != ::kNoTimeout || !lanes->run_here(key, job)) lanes->start(key);
    }
  }
  return wait_worded(timeout);
}

bool LaneWork::isCompleted() {
  if (FerroWork::isCompleted()) return true;
  Lanes::Key key;
  std::shared_ptr<Lanes::Job> job;
  if (auto lanes = this->lanes(&key, &job)) lanes->start(key);  // a poll: let it run
  return FerroWork::isCompleted();
}

FuturePtr LaneWork::getFuture() {
  Lanes::Key key;
  std::shared_ptr<Lanes::Job> job;
  if (auto lanes = this->lanes(&key, &job)) lanes->start(key);
  return FerroWork::getFuture();
}

// ---------------------------------------------------------------------------- send, recv
WorkPtr FerroBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_message("send", tensors, dst, size_, tag);
  TORCH_CHECK(!closed_, "ferro: the process group was shut down");
  if (deferred_anywhere().load(std::memory_order_acquire) > 0) hand_over_all();
  at::Tensor buf = dense(tensors[0]);  // (a copy of a non-contiguous tensor, taken now)
  auto work = c10::make_intrusive<LaneWork>(c10d::OpType::SEND, tensors);
  const double secs = seconds(Ms(0));
  auto body = [this, work, buf, dst, tag, secs]() {
    std::exception_ptr error;
    try {
      ferro_opts o = FERRO_OPTS_INIT;
      o.timeout = secs;
      int rc = api_->send(comm_, buf.data_ptr(), bytes_of(buf), dst,
                          static_cast<uint64_t>(tag), &o);
      if (rc != FERRO_OK) fail("send", rc, secs);
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
  };
  const Lanes::Key key{0, dst, 0};
  if (bytes_of(buf) <= inline_send_ && p2p_->idle(key)) {
    // tried here: never waits for room (see kInlineSend)
    ferro_opts o = FERRO_OPTS_INIT;
    o.timeout = kTrySend;
    int rc = api_->send(comm_, buf.data_ptr(), bytes_of(buf), dst, static_cast<uint64_t>(tag),
                        &o);
    if (rc != FERRO_TIMEOUT) {
      std::exception_ptr error;
      try {
        if (rc != FERRO_OK) fail("send", rc, secs);
      } catch (...) {
        error = std::current_exception();  // (raised at wait(), as from the pool)
      }
      work->complete(error);
      return noted(work);
    }
  }
  work->posted(p2p_, key, p2p_->post(key, std::move(body)));
  return noted(work);
}

WorkPtr FerroBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_message("recv", tensors, src, size_, tag);
  // (torch refuses a send to oneself; a receive from oneself would wait for its deadline)
  TORCH_CHECK_VALUE(src != rank_, "recv: rank ", src, " is this rank: no message from itself "
                    "ever comes");
  return receive(tensors, src, tag, c10d::OpType::RECV);
}

WorkPtr FerroBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  check_message("recv", tensors, 0, size_, tag);
  return receive(tensors, FERRO_ANY_SOURCE, tag, c10d::OpType::RECVANYSOURCE);
}

WorkPtr FerroBackend::receive(std::vector<at::Tensor>& tensors, int src, int tag,
                              c10d::OpType type) {
  TORCH_CHECK(!closed_, "ferro: the process group was shut down");
  // (the peer may need this rank's deferred collectives to run before it sends)
  if (deferred_anywhere().load(std::memory_order_acquire) > 0) hand_over_all();
  auto work = c10::make_intrusive<LaneWork>(type, tensors);
  const double secs = seconds(Ms(0));
  at::Tensor out = tensors[0];
  const Lanes::Key key{1, src, tag};
  const bool park = bytes_of(out) <= kInlineSend;  // (its message waits in the ring)
  auto job = p2p_->post(key, [this, work, out, src, tag, secs]() {
    std::exception_ptr error;
    try {
      at::Tensor buf = dense(out);
      ferro_opts o = FERRO_OPTS_INIT;
      o.timeout = secs;
      int from = src;
      int rc = api_->recv(comm_, buf.data_ptr(), bytes_of(buf), src,
                          static_cast<uint64_t>(tag), &from, &o);
      if (rc != FERRO_OK) fail("recv", rc, secs);
      work->source_ = from;
      write_back(out, buf);
    } catch (...) {
      error = std::current_exception();
    }
    work->complete(error);
  }, park);
  work->posted(p2p_, key, std::move(job));
  return noted(work);
}

}  // namespace ferro_torch
