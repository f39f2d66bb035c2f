// What sparktrain's TensorFlow kernels share (tf_kernels.cc: allreduce, grouped allreduce,
// broadcast, reducescatter; tf_ragged_kernels.cc: allgather and alltoall, whose first dimension
// differs between ranks): the engine's dtype codes, the timeline's buffer, the current
// communicator held for one collective, the engine's codes as TensorFlow's status, and
// CollectiveKernel, which runs a collective at once, on the engine's thread (a gradient bucket,
// reducer.h) or through the TensorFlow 1 graph sequencer (tf_sequencer.h).
#ifndef SPARKTRAIN_TF_KERNEL_H
#define SPARKTRAIN_TF_KERNEL_H

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <vector>

#include "collective.h"
#include "reducer.h"
#include "tf_sequencer.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#define SPARKTRAIN_REDUCIBLE "{half, bfloat16, float, double, int32, int64, uint8, int8, int16, uint16, bool}"

namespace sparktrain_tk {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::DataType;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;
namespace shape_inference = ::tensorflow::shape_inference;

inline constexpr int kErrLen = 1024;
inline constexpr int kMaxDims = 64;            // as sparktrain.native's ragged collectives
inline constexpr int kMeta = 2 + kMaxDims;     // [ndim, dtype code, dims padded to kMaxDims]
inline const char *const kDtypeNames[] = {"float16", "bfloat16", "float32", "float64", "int32", "int64",
                                   "uint8",   "int8",     "int16",   "uint16",  "bool"};

inline int DtypeCode(DataType dt) {
  switch (dt) {
    case ::tensorflow::DT_HALF: return STC_FLOAT16;
    case ::tensorflow::DT_BFLOAT16: return STC_BFLOAT16;
    case ::tensorflow::DT_FLOAT: return STC_FLOAT32;
    case ::tensorflow::DT_DOUBLE: return STC_FLOAT64;
    case ::tensorflow::DT_INT32: return STC_INT32;
    case ::tensorflow::DT_INT64: return STC_INT64;
    case ::tensorflow::DT_UINT8: return STC_UINT8;
    case ::tensorflow::DT_INT8: return STC_INT8;
    case ::tensorflow::DT_INT16: return STC_INT16;
    case ::tensorflow::DT_UINT16: return STC_UINT16;
    case ::tensorflow::DT_BOOL: return STC_BOOL;
    default: return -1;
  }
}

// -- timeline -----------------------------------------------------------------------------------

inline std::atomic<bool> timeline_on{false};
inline std::mutex timeline_mu;
inline std::string timeline_buf;

inline double NowUs() {  // the epoch's microseconds, as Python's time.time() * 1e6
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

// One line "label\tbytes\tstart_us\tend_us\tqueued_us": queued_us is when a collective run on the
// engine's thread was handed over (its inputs existed), 0 for one run in place.
inline void Record(const std::string &label, uint64_t bytes, double start, double end, double queued) {
  char nums[128];
  snprintf(nums, sizeof nums, "\t%llu\t%.3f\t%.3f\t%.3f\n", static_cast<unsigned long long>(bytes), start, end,
           queued);
  std::lock_guard<std::mutex> lock(timeline_mu);
  timeline_buf += label;
  timeline_buf += nums;
}

// -- the communicator ---------------------------------------------------------------------------

// The current communicator, held (its lock taken) for as long as this lives.
class Held {
 public:
  Held() : comm_(stc_current_acquire()) {}
  ~Held() { stc_current_release(); }
  Held(const Held &) = delete;
  Held &operator=(const Held &) = delete;
  stc_comm *get() const { return comm_; }

 private:
  stc_comm *comm_;
};

inline Status NoCommunicator(const char *what) {
  return errors::FailedPrecondition(
      what, ": sparktrain's native collective engine is not running in this process; call "
      "sparktrain.tensorflow.init() first (after shutdown(), init() again)");
}

// An engine's STC_E_* code as TensorFlow's status, with the whole message.
inline Status Coded(int rc, const std::string &msg) {
  switch (rc) {
    case STC_OK: return Status();
    case STC_E_TIMEOUT: return errors::DeadlineExceeded(msg);
    case STC_E_PEER: return errors::Unavailable(msg);
    case STC_E_MISMATCH:
    case STC_E_BROKEN: return errors::FailedPrecondition(msg);
    case STC_E_ARG: return errors::InvalidArgument(msg);
    default: return errors::Internal(msg);
  }
}

inline Status Mapped(int rc, stc_comm *comm, const char *err) {
  return Coded(rc, "rank " + std::to_string(stc_comm_rank(comm)) + ": " + err);
}

inline void DimsOf(const TensorShape &shape, std::vector<int64_t> *dims) {
  dims->clear();
  for (int i = 0; i < shape.dims(); ++i) dims->push_back(shape.dim_size(i));
  if (dims->empty()) dims->push_back(0);  // a valid pointer; ndim says 0
}

inline char *DataOf(Tensor *t) {
  static char empty;
  auto data = t->tensor_data();
  return data.empty() ? &empty : const_cast<char *>(data.data());
}

// -- kernels ------------------------------------------------------------------------------------

// OP_REQUIRES and OP_REQUIRES_OK for AsyncOpKernels, whose done the caller runs: on failure, set
// the op's status and return.
#define REQUIRE(ctx, cond, status) \
  do {                             \
    if (!(cond)) {                 \
      (ctx)->SetStatus(status);    \
      return;                      \
    }                              \
  } while (0)
#define REQUIRE_OK(ctx, expr)  \
  do {                         \
    Status _s = (expr);        \
    if (!_s.ok()) {            \
      (ctx)->SetStatus(_s);    \
      return;                  \
    }                          \
  } while (0)

// Eagerly and in a tf.function (sequence_key < 0) a kernel runs its collective at once, holding
// the current communicator; one built with overlap=true (a gradient bucket in a tf.function) hands
// it to the engine's thread (reducer.h) and returns, so the executor goes on with backprop.
// Built into a TensorFlow 1 graph (sequence_key >= 0) it hands the collective to the sequencer
// (tf_sequencer.h) and returns, leaving the session's thread free; the sequencer's thread runs
// it, with the communicator held, once every rank has it waiting.
class CollectiveKernel : public AsyncOpKernel {
 public:
  CollectiveKernel(OpKernelConstruction *ctx, const char *what) : AsyncOpKernel(ctx), what_(what) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sequence_key", &key_));
    if (ctx->HasAttr("overlap")) OP_REQUIRES_OK(ctx, ctx->GetAttr("overlap", &overlap_));
    for (char &ch : label_)
      if (ch == '\t' || ch == '\n') ch = ' ';
  }

  // A kernel that hands its collective over returns at once: TensorFlow's executor then runs it
  // on its own thread as soon as its inputs exist, instead of queueing it behind the long ops
  // (backprop's) its inter-op pool is busy with, so a bucket starts as soon as its gradients do.
  bool IsExpensive() override { return key_ < 0 && !overlap_; }

  void ComputeAsync(OpKernelContext *ctx, DoneCallback done) override {
    if (key_ < 0 && !overlap_) {
      {
        Held held;
        Timed(ctx, held.get(), 0);
      }
      done();
      return;
    }
    const double queued = key_ < 0 && timeline_on.load(std::memory_order_relaxed) ? NowUs() : 0;
    sparktrain::SequencedOp op;
    op.run = [this, ctx, queued](stc_comm *comm) { Timed(ctx, comm, queued); };
    op.fail = [ctx](int rc, const std::string &msg) { ctx->SetStatus(Coded(rc, msg)); };
    op.done = std::move(done);
    if (key_ >= 0)
      sparktrain::SequencerEnqueue(key_, std::move(op));
    else
      sparktrain::ReducerEnqueue(std::move(op));
  }

 protected:
  // The collective on comm (current, held, not NULL).
  virtual void Run(OpKernelContext *ctx, stc_comm *comm) = 0;

  // queued: when the collective was handed to the engine's thread (timeline on), else 0.
  void Timed(OpKernelContext *ctx, stc_comm *comm, double queued) {
    REQUIRE(ctx, comm, NoCommunicator(what_));
    const bool timed = timeline_on.load(std::memory_order_relaxed);
    const double start = timed ? NowUs() : 0;
    uint64_t bytes = 0;
    for (int i = 0; i < ctx->num_inputs(); ++i) bytes += ctx->input(i).TotalBytes();
    Run(ctx, comm);
    if (timed && ctx->status().ok()) Record(label_, bytes, start, NowUs(), queued);
  }

  // Allocates output i as a copy of input i.
  bool CopyToOutput(OpKernelContext *ctx, int i, Tensor **out) {
    const Tensor &in = ctx->input(i);
    Status s = ctx->allocate_output(i, in.shape(), out);
    if (!s.ok()) {
      ctx->SetStatus(s);
      return false;
    }
    auto src = in.tensor_data();
    if (!src.empty()) std::memcpy(DataOf(*out), src.data(), src.size());
    return true;
  }

  // Output 0 as a copy of input 0, then `call(out, dims, err)` (the engine, in place on it):
  // allreduce and broadcast.
  template <typename Call>
  void InPlace(OpKernelContext *ctx, stc_comm *comm, Call call) {
    Tensor *out = nullptr;
    if (!CopyToOutput(ctx, 0, &out)) return;
    std::vector<int64_t> dims;
    DimsOf(out->shape(), &dims);
    char err[kErrLen] = {0};
    int rc = call(out, dims.data(), err);
    REQUIRE_OK(ctx, Mapped(rc, comm, err));
  }

  const char *what_;
  std::string label_;
  int64_t key_ = -1;
  bool overlap_ = false;
};

// The shape function of the ops whose output has the input's trailing dimensions and rows that
// only the collective decides (allgather, reducescatter, alltoall): output 0 is [?, dims[1:]].
inline Status RowsUnknown(shape_inference::InferenceContext *c) {
  shape_inference::ShapeHandle in, rest, out;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &in));
  TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
  TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
  c->set_output(0, out);
  return Status();
}

}  // namespace sparktrain_tk

#endif  // SPARKTRAIN_TF_KERNEL_H
