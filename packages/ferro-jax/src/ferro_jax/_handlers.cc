// ferro-jax's XLA FFI handlers (CPU): ferro's collectives on the buffers XLA hands over.
//
// Built at first use by ferro_jax._build (g++ against jax.ffi.include_dir() and
// ferro_backend.get_include()), loaded with ctypes, registered with jax.ffi.register_ffi_target.
//
//   ferro_jax_door   the engine's door (ferro/engine.h): one collective on a same-host engine,
//                    no Python, no GIL; the communicator is slot `slot` of this library's table
//                    (filled by ferro_jax_attach from a capsule's pointer, once per backend).
//   ferro_jax_py     everything else (send/recv, TCP/MPI/hierarchical backends): a call into
//                    Python through the function ferro_jax_set_python registered (a ctypes
//                    callback, which takes the GIL), on the same buffers (no copy).
//
// All take an XLA token first and return one first: ferro_jax's primitive threads its ordered
// effect's token through them, so XLA keeps every rank's calls in program order, one at a time
// (XLA:CPU's thunk executor orders thunks linked by a token; without one it runs independent
// custom calls concurrently). barrier (and send, on the Python path) return a uint8 "done" flag.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "ferro/engine.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define FJ_EXPORT __attribute__((visibility("default")))

namespace {

constexpr int kMaxComms = 1024;
std::atomic<ferro_comm*> g_comms[kMaxComms];
std::atomic<int> g_used{0};

// kinds (ferro_jax._primitive.KINDS)
enum Kind : int32_t {
  BARRIER = 0, ALLREDUCE = 1, REDUCE = 2, REDUCE_SCATTER = 3, ALL_GATHER = 4, BROADCAST = 5,
  ALL_TO_ALL = 6
};

struct Type {
  int dtype;         // ferro_dtype
  int per_item;      // door items per XLA element (2: complex as pairs of floats)
  const char* name;  // the type the call's header names (NULL: the door's own; kByteName: the
                     // type_name attribute, the dtype's own code, ferro_collective's dtype_code)
};

const char kByteName[] = "";  // a type the door moves as bytes: its header names the real one

// XLA's element type -> the door's; reductions=false admits any type as bytes
bool door_type(ffi::DataType t, bool reductions, Type* out) {
  switch (t) {
    case ffi::DataType::PRED: *out = {FERRO_BOOL, 1, nullptr}; return true;
    case ffi::DataType::S8: *out = {FERRO_INT8, 1, nullptr}; return true;
    case ffi::DataType::S16: *out = {FERRO_INT16, 1, nullptr}; return true;
    case ffi::DataType::S32: *out = {FERRO_INT32, 1, nullptr}; return true;
    case ffi::DataType::S64: *out = {FERRO_INT64, 1, nullptr}; return true;
    case ffi::DataType::U8: *out = {FERRO_UINT8, 1, nullptr}; return true;
    case ffi::DataType::U16: *out = {FERRO_UINT16, 1, nullptr}; return true;
    case ffi::DataType::U32: *out = {FERRO_UINT32, 1, nullptr}; return true;
    case ffi::DataType::U64: *out = {FERRO_UINT64, 1, nullptr}; return true;
    case ffi::DataType::F16: *out = {FERRO_FLOAT16, 1, nullptr}; return true;
    case ffi::DataType::F32: *out = {FERRO_FLOAT32, 1, nullptr}; return true;
    case ffi::DataType::F64: *out = {FERRO_FLOAT64, 1, nullptr}; return true;
    case ffi::DataType::BF16: *out = {FERRO_BFLOAT16, 1, nullptr}; return true;
    case ffi::DataType::C64: *out = {FERRO_FLOAT32, 2, "<c8"}; return true;
    case ffi::DataType::C128: *out = {FERRO_FLOAT64, 2, "<c16"}; return true;
    default: break;
  }
  if (reductions) return false;
  size_t width = ffi::ByteWidth(t);
  if (width == 0) return false;
  *out = {FERRO_UINT8, static_cast<int>(width), kByteName};
  return true;
}

ffi::ErrorCode code_of(int status) {
  switch (status) {
    case FERRO_TIMEOUT: return ffi::ErrorCode::kDeadlineExceeded;
    case FERRO_FAILED: return ffi::ErrorCode::kUnavailable;
    case FERRO_MISMATCH: return ffi::ErrorCode::kFailedPrecondition;
    case FERRO_INVALID: return ffi::ErrorCode::kInvalidArgument;
    case FERRO_CLOSED: return ffi::ErrorCode::kCancelled;
    case FERRO_UNSUPPORTED: return ffi::ErrorCode::kUnimplemented;
    case FERRO_NOMEM: return ffi::ErrorCode::kResourceExhausted;
    default: return ffi::ErrorCode::kInternal;
  }
}

// "[ferro FERRO_MISMATCH] <ferro's message>": ferro_jax.errors reads the status back
ffi::Error door_error(ferro_comm* c, int status) {
  const ferro_engine_api* f = ferro_api(c);
  std::string msg = "[ferro ";
  msg += f->status_name(status);
  msg += "] ";
  const char* why = f->last_error();
  msg += (why != nullptr && *why != '\0') ? why : "(no message)";
  return ffi::Error(code_of(status), msg);
}

// Python's function that aborts the backend of a slot whose collective timed out
// (ferro_jax_set_abandon): its messages are on their way, and a late peer would otherwise take
// them for a live call and return a result built from one this rank gave up on
using AbandonFn = void (*)(int64_t, const char*);
std::atomic<AbandonFn> g_abandon{nullptr};

ffi::Error collective_error(int64_t slot, ferro_comm* c, int status) {
  ffi::Error error = door_error(c, status);
  AbandonFn abandon = g_abandon.load(std::memory_order_acquire);
  if (status == FERRO_TIMEOUT && abandon != nullptr) abandon(slot, error.message().c_str());
  return error;
}

ffi::Error comm_of(int64_t slot, ferro_comm** out) {
  if (slot < 0 || slot >= g_used.load(std::memory_order_acquire)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "[ferro FERRO_INVALID] ferro_jax: this computation names communicator " +
                          std::to_string(slot) + ", which this process never attached (an "
                          "executable from another process's compilation cache?)");
  }
  *out = g_comms[slot].load(std::memory_order_acquire);
  return ffi::Error::Success();
}

// ---- the rank's cores for XLA's threads. ferro binds a rank's thread to a core of its own when
// the ranks are as many as the cores (FERRO_SHM_BIND), and the engine's waits spin there. XLA runs
// these handlers on its own threads (the CPU client's pool, made when JAX first needed it: before
// the binding if jax.distributed.initialize or a computation came first, and then free to run on
// the peer's core, where a spin keeps the peer it waits for from running). So each thread that
// runs a handler takes the rank's cores once (ferro_jax_pin_threads; nothing when not bound).
cpu_set_t g_pin_set;
std::atomic<int> g_pin_generation{0};
thread_local int t_pinned_generation = 0;

inline void pin_this_thread() {
  int generation = g_pin_generation.load(std::memory_order_acquire);
  if (generation == t_pinned_generation) return;
  t_pinned_generation = generation;
  pthread_setaffinity_np(pthread_self(), sizeof g_pin_set, &g_pin_set);  // best effort
}

ffi::Error DoorImpl(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::Token>,
                    ffi::Result<ffi::AnyBuffer> y, int64_t slot, int32_t kind, int32_t op,
                    int32_t root, double timeout, int32_t marked, std::string_view type_name) {
  pin_this_thread();
  ferro_comm* c = nullptr;
  if (ffi::Error e = comm_of(slot, &c); e.failure()) return e;
  const ferro_engine_api* f = ferro_api(c);
  ferro_opts o = FERRO_OPTS_INIT;
  o.timeout = timeout;
  Type t;
  bool reduces = kind == ALLREDUCE || kind == REDUCE || kind == REDUCE_SCATTER;
  if (!door_type(x.element_type(), reduces, &t)) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "[ferro FERRO_UNSUPPORTED] ferro_jax: the engine does not reduce this "
                      "element type");
  }
  char named[9] = {0};  // the header's dtype: at most 8 chars, NUL-terminated here
  if (t.name == kByteName) {
    // ferro_collective.header.dtype_code of the jax dtype (lowering): float8_e4m3fn and
    // float8_e5m2 (same width, both bytes to the door) name two dtypes, so ranks that disagree
    // get a mismatch instead of reading each other's bytes in their own type
    std::memcpy(named, type_name.data(), type_name.size() < 8 ? type_name.size() : 8);
    o.type_name = named[0] != '\0' ? named : "|u1";
  } else {
    o.type_name = t.name;
  }
  auto dims = x.dimensions();
  std::vector<int64_t> shape(dims.begin(), dims.end());
  if (t.per_item != 1) shape.push_back(t.per_item);  // complex pairs, bytes of odd types
  if (marked) shape.push_back(1);  // its rank makes its derivative's call later (_ad.py)
  o.ndim = static_cast<int32_t>(shape.size());
  o.dims = shape.data();
  const void* send = x.untyped_data();
  void* recv = y->untyped_data();
  size_t in_items = x.element_count() * t.per_item;
  size_t out_items = y->element_count() * t.per_item;
  int n = f->world_size(c);
  int rc;
  switch (kind) {
    case ALLREDUCE:
      rc = f->allreduce(c, send, recv, in_items, t.dtype, op, &o);
      break;
    case REDUCE:  // the fold on root, zeros elsewhere (broadcast's transpose)
      rc = f->reduce(c, send, f->rank(c) == root ? recv : nullptr, in_items, t.dtype, op, root,
                     &o);
      if (rc == FERRO_OK && f->rank(c) != root) std::memset(recv, 0, y->size_bytes());
      break;
    case REDUCE_SCATTER:
      rc = f->reduce_scatter(c, send, recv, out_items, t.dtype, op, &o);
      break;
    case ALL_GATHER:
      rc = f->all_gather(c, send, recv, in_items, t.dtype, &o);
      break;
    case BROADCAST:
      rc = f->broadcast(c, f->rank(c) == root ? send : nullptr, recv, in_items, t.dtype, root,
                        &o);
      break;
    case ALL_TO_ALL:
      rc = f->all_to_all(c, send, recv, in_items / static_cast<size_t>(n), t.dtype, &o);
      break;
    default:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "[ferro FERRO_INVALID] ferro_jax: unknown kind " + std::to_string(kind));
  }
  if (rc != FERRO_OK) return collective_error(slot, c, rc);
  return ffi::Error::Success();
}

ffi::Error BarrierImpl(ffi::Token, ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> done,
                       int64_t slot, double timeout) {
  pin_this_thread();
  ferro_comm* c = nullptr;
  if (ffi::Error e = comm_of(slot, &c); e.failure()) return e;
  ferro_opts o = FERRO_OPTS_INIT;
  o.timeout = timeout;
  int rc = ferro_api(c)->barrier(c, &o);
  if (rc != FERRO_OK) return collective_error(slot, c, rc);
  std::memset(done->untyped_data(), 1, done->size_bytes());
  return ffi::Error::Success();
}

// ---- the Python path: fn(call, n_in, in_ptrs, n_out, out_ptrs, err, err_len) -> 0 or not
using PyFn = int (*)(int64_t, int64_t, void* const*, int64_t, void* const*, char*, int64_t);
std::atomic<PyFn> g_python{nullptr};

ffi::Error PyImpl(ffi::Token, ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                  ffi::RemainingRets rets, int64_t call) {
  pin_this_thread();
  PyFn fn = g_python.load(std::memory_order_acquire);
  if (fn == nullptr) {
    return ffi::Error::Internal("[ferro FERRO_INVALID] ferro_jax: no Python function set");
  }
  std::vector<void*> ins(args.size()), outs(rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    ins[i] = b->untyped_data();
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    outs[i] = (*b)->untyped_data();
  }
  char err[2048];
  err[0] = '\0';
  int rc = fn(call, static_cast<int64_t>(ins.size()), ins.data(),
              static_cast<int64_t>(outs.size()), outs.data(), err, sizeof err);
  if (rc != 0) {
    err[sizeof err - 1] = '\0';
    return ffi::Error(static_cast<ffi::ErrorCode>(rc), std::string(err));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ferro_jax_door, DoorImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("slot")
                                  .Attr<int32_t>("kind")
                                  .Attr<int32_t>("op")
                                  .Attr<int32_t>("root")
                                  .Attr<double>("timeout")
                                  .Attr<int32_t>("marked")
                                  .Attr<std::string_view>("type_name"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ferro_jax_barrier, BarrierImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()  // done (uint8), for waiting on it
                                  .Attr<int64_t>("slot")
                                  .Attr<double>("timeout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ferro_jax_py, PyImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets()
                                  .Attr<int64_t>("call"));

extern "C" {

// the communicator a capsule's pointer names, attached (a reference of ours, kept for the life
// of the process: compiled executables name its slot); its slot, or -1 with why
FJ_EXPORT int64_t ferro_jax_attach(void* handle, char* why, size_t why_len) {
  ferro_comm* c = ferro_attach(handle, why, why_len);
  if (c == nullptr) return -1;
  int slot = g_used.load(std::memory_order_relaxed);
  if (slot >= kMaxComms) {
    ferro_api(c)->release(c);
    ferro_attach_why(why, why_len, "ferro_jax_attach: too many communicators attached", 0, 0);
    return -1;
  }
  g_comms[slot].store(c, std::memory_order_release);
  g_used.store(slot + 1, std::memory_order_release);  // attach runs under the GIL: no race
  return slot;
}

FJ_EXPORT int ferro_jax_rank(int64_t slot) {
  ferro_comm* c = g_comms[slot].load();
  return ferro_api(c)->rank(c);
}

FJ_EXPORT int ferro_jax_world_size(int64_t slot) {
  ferro_comm* c = g_comms[slot].load();
  return ferro_api(c)->world_size(c);
}

FJ_EXPORT void ferro_jax_set_python(PyFn fn) { g_python.store(fn, std::memory_order_release); }

FJ_EXPORT void ferro_jax_set_abandon(AbandonFn fn) {
  g_abandon.store(fn, std::memory_order_release);
}

// every thread that runs a handler from now on takes these cores (once per thread); n = 0: none
FJ_EXPORT void ferro_jax_pin_threads(const int* cores, int n) {
  if (n <= 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int i = 0; i < n; ++i) {
    if (cores[i] >= 0 && cores[i] < CPU_SETSIZE) CPU_SET(cores[i], &set);
  }
  g_pin_set = set;  // under the GIL, before the generation that publishes it
  g_pin_generation.fetch_add(1, std::memory_order_acq_rel);
}

// one door allreduce on raw buffers, from C: the yardstick of the per-call overhead
FJ_EXPORT int ferro_jax_c_allreduce(int64_t slot, const void* send, void* recv, size_t count, int dtype,
                          int op, int repeat) {
  ferro_comm* c = g_comms[slot].load();
  const ferro_engine_api* f = ferro_api(c);
  for (int i = 0; i < repeat; ++i) {
    int rc = f->allreduce(c, send, recv, count, dtype, op, nullptr);
    if (rc != FERRO_OK) return rc;
  }
  return FERRO_OK;
}

}  // extern "C"
