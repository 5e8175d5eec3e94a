// p2p.cpp: torch's send, recv and recv from any source on the door's point-to-point calls,
// without Python and without the GIL.
//
// The door's send returns once the message is in the peer's ring (a large one waits for the
// peer to take its pieces); its recv waits for the message. torch's isend/irecv must return
// at once, so a message runs on a thread of the group's point-to-point pool (Lanes): one lane
// per destination for sends, per (source, tag) for receives (per tag for any source), each
// lane's operations in issue order, different lanes at once (a receive that waits never holds
// up another tag's or another peer's). A small send to a destination with nothing pending
// runs in the caller's thread: it only writes into the ring, and returns a finished Work.
#include "ferro_c10d.hpp"

namespace ferro_torch {

namespace {

// messages up to this size are sent in the caller's thread when their lane is idle (they fit
// the ring's room unless the peer has left thousands of messages unread)
constexpr size_t kInlineSend = 64 << 10;

void check_message(const char* name, const std::vector<at::Tensor>& tensors, int peer,
                   int size, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, name, ": ", tensors.size(), " tensors, expected 1");
  check_cpu(name, tensors[0]);
  TORCH_CHECK_VALUE(peer >= 0 && peer < size, name, ": rank ", peer, " is not a rank of ", size);
  TORCH_CHECK_VALUE(tag >= 0, name, ": tag ", tag, " is negative");
}

size_t bytes_of(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

}  // namespace

// A Work that also says who sent its message (recv from any source).
class RecvWork : public FerroWork {
 public:
  using FerroWork::FerroWork;
  int sourceRank() const override { return source_.load(); }
  std::atomic<int> source_{-1};
};

// ---------------------------------------------------------------------------- Lanes
Lanes::~Lanes() { stop(); }

void Lanes::post(Key key, std::function<void()> job) {
  std::lock_guard<std::mutex> g(mu_);
  TORCH_CHECK(!stopping_, "ferro: the process group was shut down");
  Lane& lane = lanes_[key];
  lane.jobs.push_back(std::move(job));
  if (lane.running) return;  // its thread takes it after the ones before it
  lane.running = true;
  ready_.push_back(key);
  if (ready_.size() > idle_)  // every thread is busy (a receive may wait long): one more
    threads_.emplace_back([this] { run(); });
  else
    cv_.notify_one();
}

bool Lanes::idle(Key key) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = lanes_.find(key);
  return it == lanes_.end() || !it->second.running;
}

void Lanes::run() {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(g, [this] { return stopping_ || !ready_.empty(); });
    --idle_;
    if (ready_.empty()) return;  // stopping, and nothing left to run
    Key key = ready_.front();
    ready_.pop_front();
    Lane& lane = lanes_[key];
    std::function<void()> job = std::move(lane.jobs.front());
    lane.jobs.pop_front();
    g.unlock();
    job();  // (completes its Work: never throws)
    job = nullptr;
    g.lock();
    Lane& after = lanes_[key];  // (the map may have grown meanwhile; nodes stay put)
    if (after.jobs.empty())
      lanes_.erase(key);
    else
      ready_.push_back(key);  // behind the other lanes waiting
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
}

// ---------------------------------------------------------------------------- send, recv
WorkPtr FerroBackend::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_message("send", tensors, dst, size_, tag);
  TORCH_CHECK(!closed_, "ferro: the process group was shut down");
  at::Tensor buf = dense(tensors[0]);  // (a copy of a non-contiguous tensor, taken now)
  auto work = c10::make_intrusive<FerroWork>(c10d::OpType::SEND, tensors);
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
  if (bytes_of(buf) <= kInlineSend && p2p_.idle(key))
    body();  // (an error is raised at wait(), as from the pool)
  else
    p2p_.post(key, std::move(body));
  return noted(work);
}

WorkPtr FerroBackend::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_message("recv", tensors, src, size_, tag);
  return receive(tensors, src, tag, c10d::OpType::RECV);
}

WorkPtr FerroBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  check_message("recv", tensors, 0, size_, tag);
  return receive(tensors, FERRO_ANY_SOURCE, tag, c10d::OpType::RECVANYSOURCE);
}

WorkPtr FerroBackend::receive(std::vector<at::Tensor>& tensors, int src, int tag,
                              c10d::OpType type) {
  TORCH_CHECK(!closed_, "ferro: the process group was shut down");
  auto work = c10::make_intrusive<RecvWork>(type, tensors);
  const double secs = seconds(Ms(0));
  at::Tensor out = tensors[0];
  p2p_.post(Lanes::Key{1, src, tag}, [this, work, out, src, tag, secs]() {
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
  });
  return noted(work);
}

}  // namespace ferro_torch
