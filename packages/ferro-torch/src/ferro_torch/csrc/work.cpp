// work.cpp: the Works of backend "ferro" (one operation, a coalesced block), the door tickets
// an operation holds, and ferro/engine.h's names for torch's dtypes and reduce ops.
#include "ferro_c10d.hpp"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace ferro_torch {

FuturePtr tensor_future() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

std::exception_ptr backend_error(const std::string& msg) {
  return std::make_exception_ptr(
      c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg));
}

static void settle(const FuturePtr& f, const std::vector<at::Tensor>& outputs,
                   const std::exception_ptr& error) {
  if (error)
    f->setError(error);
  else
    f->markCompleted(c10::IValue(outputs));
}

// ---------------------------------------------------------------------------- FerroWork
FerroWork::FerroWork(c10d::OpType type, std::vector<at::Tensor> outputs)
    : c10d::Work(-1, type), outputs_(std::move(outputs)) {}

void FerroWork::complete(std::exception_ptr error) {
  FuturePtr f = finish(error);
  if (f) settle(f);  // (its callbacks run here, outside the lock)
}

FuturePtr FerroWork::finish(std::exception_ptr error) {
  FuturePtr f;
  {
    std::lock_guard<std::mutex> g(mutex_);
    completed_ = true;
    exception_ = error;
    f = future_;
  }
  cv_.notify_all();
  return f;
}

void FerroWork::settle(const FuturePtr& f) { ferro_torch::settle(f, outputs_, exception_); }

std::vector<at::Tensor> FerroWork::result() { return outputs_; }

FuturePtr FerroWork::getFuture() {
  std::unique_lock<std::mutex> g(mutex_);
  if (future_) return future_;
  future_ = tensor_future();
  if (!completed_) return future_;  // complete() settles it
  FuturePtr f = future_;
  std::exception_ptr error = exception_;
  g.unlock();
  ferro_torch::settle(f, outputs_, error);
  return f;
}

bool FerroWork::wait_worded(Ms timeout) {
  if (timeout == ::kNoTimeout) return c10d::Work::wait(timeout);
  try {
    return c10d::Work::wait(timeout);
  } catch (const c10::Error&) {
    if (c10d::Work::isCompleted()) throw;  // (the operation's own error)
    // c10d's own words are a bare "Operation timed out!": say which call, and that it goes on
    std::string op = c10d::opTypeToString(retrieveOpType());
    std::transform(op.begin(), op.end(), op.begin(), [](unsigned char ch) {
      return static_cast<char>(std::tolower(ch));
    });
    std::rethrow_exception(backend_error(
        "ferro " + op + ": Timed out waiting " + std::to_string(timeout.count()) + "ms for " +
        op + " to complete (Work.wait's timeout); the work goes on: a later wait() can still "
        "complete it, and a receive still takes the message it waits for"));
  }
}

// ---------------------------------------------------------------------------- DeferredWork
DeferredWork::DeferredWork(c10d::OpType type, std::vector<at::Tensor> outputs,
                           c10::weak_intrusive_ptr<FerroBackend> owner)
    : FerroWork(type, std::move(outputs)), owner_(std::move(owner)) {}

bool DeferredWork::wait(Ms timeout) {
  if (!c10d::Work::isCompleted()) {
    if (auto b = owner_.lock()) {
      if (timeout == ::kNoTimeout)
        b->run_deferred(this);
      else
        b->hand_over();  // (the worker runs it while this thread waits as long as it says)
    }
  }
  return wait_worded(timeout);
}

bool DeferredWork::isCompleted() {
  if (!c10d::Work::isCompleted())
    if (auto b = owner_.lock()) b->run_deferred(this);
  return c10d::Work::isCompleted();
}

FuturePtr DeferredWork::getFuture() {
  if (!c10d::Work::isCompleted())
    if (auto b = owner_.lock()) b->run_deferred(this);
  return FerroWork::getFuture();
}

// ---------------------------------------------------------------------------- CoalescedWork
CoalescedWork::CoalescedWork(std::vector<WorkPtr> works)
    : c10d::Work(-1, c10d::OpType::COALESCED), works_(std::move(works)) {}

bool CoalescedWork::isCompleted() {
  for (auto& w : works_)
    if (!w->isCompleted()) return false;
  return true;
}

bool CoalescedWork::isSuccess() const {
  for (auto& w : works_)
    if (!w->isSuccess()) return false;
  return true;
}

bool CoalescedWork::wait(Ms timeout) {
  for (auto& w : works_) w->wait(timeout);  // (each gets the whole timeout)
  return true;
}

std::vector<at::Tensor> CoalescedWork::result() {
  std::vector<at::Tensor> out;
  for (auto& w : works_)
    for (auto& t : w->result()) out.push_back(t);
  return out;
}

FuturePtr CoalescedWork::getFuture() {
  std::lock_guard<std::mutex> g(lock_);
  if (future_) return future_;
  future_ = tensor_future();
  if (works_.empty()) {
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{}));
    return future_;
  }
  // complete when every work has: count them down, the first error wins
  struct Left {
    std::mutex m;
    size_t n;
    std::exception_ptr error;
  };
  auto left = std::make_shared<Left>();
  left->n = works_.size();
  FuturePtr all = future_;
  std::vector<at::Tensor> outputs = result();
  for (auto& w : works_) {
    w->getFuture()->addCallback([left, all, outputs](c10::ivalue::Future& f) {
      std::exception_ptr error;
      {
        std::lock_guard<std::mutex> lg(left->m);
        if (f.hasError() && !left->error) left->error = f.exception_ptr();
        if (--left->n != 0) return;
        error = left->error;
      }
      settle(all, outputs, error);
    });
  }
  return future_;
}

// ---------------------------------------------------------------------------- Tickets
Tickets::Tickets(ferro_comm* c, const ferro_engine_api* api, size_t n) : c_(c), api_(api) {
  tickets_.reserve(n);
  for (size_t i = 0; i < n; ++i) tickets_.push_back(api_->reserve(c_));
}

Tickets::Tickets(Tickets&& other) noexcept
    : c_(other.c_), api_(other.api_), tickets_(std::move(other.tickets_)), used_(other.used_) {
  other.tickets_.clear();
  other.used_ = 0;
}

Tickets::~Tickets() {
  for (size_t i = used_; i < tickets_.size(); ++i) api_->skip(c_, tickets_[i]);
}

int64_t Tickets::next() {
  TORCH_INTERNAL_ASSERT(used_ < tickets_.size(), "ferro: an operation ran out of tickets");
  return tickets_[used_++];
}

// ---------------------------------------------------------------------------- names
int door_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FERRO_FLOAT32;
    case at::kDouble: return FERRO_FLOAT64;
    case at::kChar: return FERRO_INT8;
    case at::kShort: return FERRO_INT16;
    case at::kInt: return FERRO_INT32;
    case at::kLong: return FERRO_INT64;
    case at::kByte: return FERRO_UINT8;
    case at::kUInt16: return FERRO_UINT16;
    case at::kUInt32: return FERRO_UINT32;
    case at::kUInt64: return FERRO_UINT64;
    case at::kHalf: return FERRO_FLOAT16;
    case at::kBFloat16: return FERRO_BFLOAT16;
    case at::kBool: return FERRO_BOOL;
    default: return -1;
  }
}

int door_op(const c10d::ReduceOp& op, int dtype, const char* name) {
  using R = c10d::ReduceOp;
  const bool floating = dtype == FERRO_FLOAT32 || dtype == FERRO_FLOAT64 ||
                        dtype == FERRO_FLOAT16 || dtype == FERRO_BFLOAT16;
  switch (op.op_) {
    case R::PREMUL_SUM:
    case R::UNUSED:
      TORCH_CHECK_VALUE(false, name, ": backend 'ferro' does not support reduce op ",
                        static_cast<int>(op.op_), "; supported: SUM, AVG, MIN, MAX, PRODUCT, "
                        "BAND, BOR, BXOR");
    default:
      break;
  }
  if (dtype == FERRO_BOOL) {  // torch's logical or/and (SUM, MAX: or; PRODUCT, MIN: and)
    switch (op.op_) {
      case R::SUM: case R::MAX: case R::BOR: return FERRO_BOR;
      case R::PRODUCT: case R::MIN: case R::BAND: return FERRO_BAND;
      case R::BXOR: return FERRO_BXOR;
      default:
        TORCH_CHECK_TYPE(false, name, ": ReduceOp.AVG is not defined on bool tensors");
    }
  }
  if (dtype < 0) return -1;
  switch (op.op_) {
    case R::SUM: return FERRO_SUM;
    case R::PRODUCT: return FERRO_PROD;
    case R::MIN: return FERRO_MIN;
    case R::MAX: return FERRO_MAX;
    case R::AVG: return floating ? FERRO_AVG : -1;
    case R::BAND: return floating ? -1 : FERRO_BAND;
    case R::BOR: return floating ? -1 : FERRO_BOR;
    case R::BXOR: return floating ? -1 : FERRO_BXOR;
    default: return -1;
  }
}

Items items_of(const at::Tensor& t) {
  int dt = door_dtype(t.scalar_type());
  if (dt >= 0) return {dt, static_cast<size_t>(t.numel()), nullptr};
  // bytes, named by torch's dtype for the door's mismatch check (at most 8 characters)
  static const char* names[] = {"pt-cplx", "pt-other"};
  return {FERRO_UINT8, static_cast<size_t>(t.numel()) * t.element_size(),
          t.is_complex() ? names[0] : names[1]};
}

void check_cpu(const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.defined(), name, ": an undefined tensor");
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": backend 'ferro' takes CPU tensors, not ",
                    t.device(), " (use \"cpu:ferro,cuda:nccl\")");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, name, ": backend 'ferro' takes dense tensors "
                    "here, not ", t.layout());
}

at::Tensor dense(const at::Tensor& t) {
  if (t.is_contiguous() && !t.is_neg() && !t.is_conj()) return t;
  return t.resolve_conj().resolve_neg().contiguous();
}

void write_back(const at::Tensor& t, const at::Tensor& buf) {
  if (!buf.is_same(t)) {
    at::NoGradGuard g;
    t.copy_(buf);
  }
}

std::vector<at::Tensor> joined(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

at::Tensor span(const std::vector<at::Tensor>& ts) {
  if (ts.empty()) return at::Tensor();
  const auto& first = ts[0];
  const size_t bytes = first.numel() * first.element_size();
  const char* at = static_cast<const char*>(first.data_ptr());
  int64_t total = 0;
  for (const auto& t : ts) {
    if (!t.is_contiguous() || t.is_neg() || t.is_conj() || t.scalar_type() != first.scalar_type()
        || t.numel() != first.numel() || static_cast<const char*>(t.data_ptr()) != at
        || !t.storage().is_alias_of(first.storage()))
      return at::Tensor();
    at += bytes;
    total += t.numel();
  }
  return first.detach().as_strided({total}, {1});  // a flat view over the block
}

}  // namespace ferro_torch
