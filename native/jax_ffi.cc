// sparktrain's XLA FFI handlers for JAX on CPU: one buffer reduced in place over every rank through the
// process's current communicator (collective.h: stc_current_acquire), from inside a compiled step,
// without Python. SparktrainJaxAllreduce reduces on XLA's thread and returns once done;
// SparktrainJaxBucket (a gradient bucket) hands the buffer to the engine's thread (reducer.h) and
// returns a future at once, so XLA's thunk executor goes on with the thunks that do not read it.
//
// Not built by pip (it needs jaxlib's FFI headers, jax.ffi.include_dir()): sparktrain.keras.jax_ffi
// compiles it with reducer.cc at a rank's first use, linked against the engine library the process
// has loaded, and registers the handlers with jax.ffi.register_ffi_target.
#include <pthread.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "reducer.h"
#include "xla/ffi/api/ffi.h"

extern "C" {
#include "collective.h"
}

namespace ffi = xla::ffi;

namespace {

// The engine's dtype code for an XLA element type, or -1 where the engine does not reduce it.
int EngineDtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F16: return STC_FLOAT16;
    case ffi::DataType::BF16: return STC_BFLOAT16;
    case ffi::DataType::F32: return STC_FLOAT32;
    case ffi::DataType::F64: return STC_FLOAT64;
    case ffi::DataType::S32: return STC_INT32;
    case ffi::DataType::S64: return STC_INT64;
    case ffi::DataType::U8: return STC_UINT8;
    case ffi::DataType::S8: return STC_INT8;
    case ffi::DataType::S16: return STC_INT16;
    case ffi::DataType::U16: return STC_UINT16;
    case ffi::DataType::PRED: return STC_BOOL;
    default: return -1;
  }
}

// XLA's error code for an engine return code: a timeout, a dead peer, ranks that disagree.
ffi::ErrorCode XlaCode(int rc) {
  switch (rc) {
    case STC_E_TIMEOUT: return ffi::ErrorCode::kDeadlineExceeded;
    case STC_E_PEER: return ffi::ErrorCode::kUnavailable;
    case STC_E_MISMATCH:
    case STC_E_BROKEN: return ffi::ErrorCode::kFailedPrecondition;
    case STC_E_ARG: return ffi::ErrorCode::kInvalidArgument;
    default: return ffi::ErrorCode::kInternal;
  }
}

const char kNoEngine[] =
    "sparktrain's native engine is not running in this JAX process; call sparktrain.keras.init() on every rank first";

// buf (count elements of the engine's dtype) reduced in place with op on comm (NULL: no engine);
// an XLA error naming why not.
ffi::Error Reduce(stc_comm *comm, void *buf, int dtype, int32_t op, int64_t count) {
  if (comm == nullptr) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, kNoEngine);
  char err[1024] = {0};
  int rc = stc_allreduce(comm, buf, dtype, op, 1, &count, err, sizeof err);
  if (rc != STC_OK) return ffi::Error(XlaCode(rc), std::string("sparktrain allreduce: ") + err);
  return ffi::Error::Success();
}

// The engine's dtype of in, after copying it to out where XLA gave them apart; -1: not reducible.
int Prepare(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> &out) {
  int dtype = EngineDtype(in.element_type());
  if (dtype >= 0 && out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  return dtype;
}

const char kNotReducible[] = "sparktrain allreduce: the native engine does not reduce this dtype";

ffi::Error Allreduce(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int32_t op) {
  int dtype = Prepare(in, out);
  if (dtype < 0) return ffi::Error(ffi::ErrorCode::kInvalidArgument, kNotReducible);
  ffi::Error result = Reduce(stc_current_acquire(), out->untyped_data(), dtype, op,
                             static_cast<int64_t>(in.element_count()));
  stc_current_release();
  return result;
}

// The thread that completes the buckets' futures ("sparktrain-done"). XLA's thunk executor goes on,
// on the thread that completes a future, with the thunks that were waiting for it (the optimizer's
// updates, the next bucket's call): here, not on the engine's thread, which goes on with the next
// bucket meanwhile. Never destroyed: a process may exit with it waiting.
class Completer {
 public:
  static void Post(std::function<void()> task) {
    Completer *c = &Instance();
    std::lock_guard<std::mutex> lock(c->mu_);
    c->tasks_.push_back(std::move(task));
    if (!c->started_) {
      c->started_ = true;
      std::thread([] { Instance().Loop(); }).detach();
    }
    c->posted_.notify_one();
  }

 private:
  static Completer &Instance() {
    static Completer *c = new Completer;
    return *c;
  }

  void Loop() {
    pthread_setname_np(pthread_self(), "sparktrain-done");
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        posted_.wait(lock, [&] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable posted_;
  std::deque<std::function<void()>> tasks_;
  bool started_ = false;
};

// What a bucket's op leaves for its completion: the first failure, if any.
struct BucketState {
  ffi::Promise promise;
  std::unique_ptr<ffi::Error> error;
};

// `after`: the buffers of the bucket before this one (none for the first); not read, they only
// make XLA call this once that bucket is reduced, so every rank queues its buckets in program order.
ffi::Future Bucket(ffi::AnyBuffer in, ffi::RemainingArgs after, ffi::Result<ffi::AnyBuffer> out, int32_t op) {
  (void)after;
  auto state = std::make_shared<BucketState>();
  ffi::Future future(state->promise);
  int dtype = Prepare(in, out);
  if (dtype < 0) {
    state->promise.SetError(ffi::Error(ffi::ErrorCode::kInvalidArgument, kNotReducible));
    return future;
  }
  void *buf = out->untyped_data();
  const int64_t count = static_cast<int64_t>(in.element_count());
  sparktrain::SequencedOp queued;
  queued.run = [state, buf, dtype, op, count](stc_comm *comm) {
    ffi::Error e = Reduce(comm, buf, dtype, op, count);
    if (e.failure()) state->error = std::make_unique<ffi::Error>(std::move(e));
  };
  queued.fail = [state](int rc, const std::string &msg) {
    state->error = std::make_unique<ffi::Error>(XlaCode(rc), "sparktrain allreduce: " + msg);
  };
  queued.done = [state] {
    Completer::Post([state] {
      if (state->error) {
        state->promise.SetError(std::move(*state->error));
      } else {
        state->promise.SetAvailable();
      }
    });
  };
  sparktrain::ReducerEnqueue(std::move(queued));
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparktrainJaxAllreduce, Allreduce,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int32_t>("op"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparktrainJaxBucket, Bucket,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("op"));

// The engine ABI this handler was compiled against.
extern "C" int sparktrain_jax_ffi_abi_version(void) { return STC_ABI_VERSION; }

// Fails the buckets waiting for the engine's thread and joins it (shutdown()); the next bucket
// starts it again.
extern "C" void sparktrain_jax_ffi_stop(void) { sparktrain::ReducerStop(); }
