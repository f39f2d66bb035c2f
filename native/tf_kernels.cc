// TensorFlow CPU kernels over sparktrain's collective engine (collective.h).
//
// The only file of native/ that includes TensorFlow: sparktrain.tensorflow.kernels compiles it
// at first use (pip builds the package without TensorFlow) and loads it with
// tf.load_op_library. It links against the engine library that sparktrain.native loaded with
// ctypes, by its path, so the process holds one engine and the kernels find the communicator
// that sparktrain.tensorflow.init() brought up through stc_current_acquire(). Each kernel runs
// one collective while holding the engine's current-communicator lock: kernels run one at a
// time, and shutdown() waits for the one in flight before the communicator goes away. Kernels
// built into a TensorFlow 1 graph carry a sequence_key and run on the sequencer's thread, in the
// order the ranks agree on (tf_sequencer.h); shutdown() stops it first.
//
// The kernels copy their input into the output and reduce there (an output never aliases a
// tensor TensorFlow owns), and map the engine's failures to TensorFlow's error codes: ranks
// that disagree (and a communicator an earlier failure broke) FailedPrecondition, a wait past
// the deadline DeadlineExceeded, a dead peer Unavailable, each with the engine's message,
// which names the ranks and what differs. The ops are marked distributed-communication ops, or
// TensorFlow would replace an Unavailable error raised inside a function by an Internal one.
//
// While a timeline is on (sparktrain_tk_timeline(1)), every kernel appends one line
// "label\tbytes\tstart_us\tend_us" to a buffer that sparktrain_tk_timeline_drain() hands over.

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <vector>

#include "collective.h"
#include "tf_sequencer.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::DataType;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Status;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace errors = ::tensorflow::errors;
namespace shape_inference = ::tensorflow::shape_inference;

constexpr int kErrLen = 1024;
constexpr int kMaxDims = 64;            // as sparktrain.native's ragged collectives
constexpr int kMeta = 2 + kMaxDims;     // [ndim, dtype code, dims padded to kMaxDims]
const char *const kDtypeNames[] = {"float16", "bfloat16", "float32", "float64", "int32", "int64",
                                   "uint8",   "int8",     "int16",   "uint16",  "bool"};

int DtypeCode(DataType dt) {
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

std::atomic<bool> timeline_on{false};
std::mutex timeline_mu;
std::string timeline_buf;

double NowUs() {  // the epoch's microseconds, as Python's time.time() * 1e6
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

void Record(const std::string &label, uint64_t bytes, double start, double end) {
  char nums[96];
  snprintf(nums, sizeof nums, "\t%llu\t%.3f\t%.3f\n", static_cast<unsigned long long>(bytes), start, end);
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

Status NoCommunicator(const char *what) {
  return errors::FailedPrecondition(
      what, ": sparktrain's native collective engine is not running in this process; call "
      "sparktrain.tensorflow.init() first (after shutdown(), init() again)");
}

// An engine's STC_E_* code as TensorFlow's status, with the whole message.
Status Coded(int rc, const std::string &msg) {
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

Status Mapped(int rc, stc_comm *comm, const char *err) {
  return Coded(rc, "rank " + std::to_string(stc_comm_rank(comm)) + ": " + err);
}

void DimsOf(const TensorShape &shape, std::vector<int64_t> *dims) {
  dims->clear();
  for (int i = 0; i < shape.dims(); ++i) dims->push_back(shape.dim_size(i));
  if (dims->empty()) dims->push_back(0);  // a valid pointer; ndim says 0
}

char *DataOf(Tensor *t) {
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
// the current communicator. Built into a TensorFlow 1 graph (sequence_key >= 0) it hands the
// collective to the sequencer (tf_sequencer.h) and returns, leaving the session's thread free;
// the sequencer's thread runs it, with the communicator held, once every rank has it waiting.
class CollectiveKernel : public AsyncOpKernel {
 public:
  CollectiveKernel(OpKernelConstruction *ctx, const char *what) : AsyncOpKernel(ctx), what_(what) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("label", &label_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("sequence_key", &key_));
    for (char &ch : label_)
      if (ch == '\t' || ch == '\n') ch = ' ';
  }

  void ComputeAsync(OpKernelContext *ctx, DoneCallback done) override {
    if (key_ < 0) {
      {
        Held held;
        Timed(ctx, held.get());
      }
      done();
      return;
    }
    sparktrain::SequencedOp op;
    op.run = [this, ctx](stc_comm *comm) { Timed(ctx, comm); };
    op.fail = [ctx](int rc, const std::string &msg) { ctx->SetStatus(Coded(rc, msg)); };
    op.done = std::move(done);
    sparktrain::SequencerEnqueue(key_, std::move(op));
  }

 protected:
  // The collective on comm (current, held, not NULL).
  virtual void Run(OpKernelContext *ctx, stc_comm *comm) = 0;

  void Timed(OpKernelContext *ctx, stc_comm *comm) {
    REQUIRE(ctx, comm, NoCommunicator(what_));
    const bool timed = timeline_on.load(std::memory_order_relaxed);
    const double start = timed ? NowUs() : 0;
    uint64_t bytes = 0;
    for (int i = 0; i < ctx->num_inputs(); ++i) bytes += ctx->input(i).TotalBytes();
    Run(ctx, comm);
    if (timed && ctx->status().ok()) Record(label_, bytes, start, NowUs());
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
};

class AllreduceOp : public CollectiveKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction *ctx) : CollectiveKernel(ctx, "allreduce") {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduce_op", &op_));
  }

 protected:
  void Run(OpKernelContext *ctx, stc_comm *comm) override {
    InPlace(ctx, comm, [this, comm](Tensor *out, const int64_t *dims, char *err) {
      return stc_allreduce(comm, DataOf(out), DtypeCode(out->dtype()), op_, out->dims(), dims, err, kErrLen);
    });
  }

 private:
  int op_;
};

// N tensors of one dtype, reduced as one flat buffer (their elements concatenated in order),
// in one engine call, as sparktrain.tensorflow.hostops.grouped_allreduce does.
class GroupedAllreduceOp : public CollectiveKernel {
 public:
  explicit GroupedAllreduceOp(OpKernelConstruction *ctx) : CollectiveKernel(ctx, "grouped_allreduce") {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduce_op", &op_));
  }

 protected:
  void Run(OpKernelContext *ctx, stc_comm *comm) override {
    const int n = ctx->num_inputs();
    const DataType dt = ctx->input(0).dtype();
    int64_t total = 0;
    for (int i = 0; i < n; ++i) total += ctx->input(i).NumElements();
    Tensor flat;
    REQUIRE_OK(ctx, ctx->allocate_temp(dt, TensorShape({total}), &flat));
    char *base = DataOf(&flat);
    size_t offset = 0;
    for (int i = 0; i < n; ++i) {
      auto src = ctx->input(i).tensor_data();
      if (!src.empty()) std::memcpy(base + offset, src.data(), src.size());
      offset += src.size();
    }
    char err[kErrLen] = {0};
    int rc = stc_allreduce(comm, base, DtypeCode(dt), op_, 1, &total, err, sizeof err);
    REQUIRE_OK(ctx, Mapped(rc, comm, err));
    offset = 0;
    for (int i = 0; i < n; ++i) {
      Tensor *out = nullptr;
      REQUIRE_OK(ctx, ctx->allocate_output(i, ctx->input(i).shape(), &out));
      size_t nbytes = out->TotalBytes();
      if (nbytes) std::memcpy(DataOf(out), base + offset, nbytes);
      offset += nbytes;
    }
  }

 private:
  int op_;
};

class BroadcastOp : public CollectiveKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction *ctx) : CollectiveKernel(ctx, "broadcast") {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("root", &root_));
  }

 protected:
  void Run(OpKernelContext *ctx, stc_comm *comm) override {
    InPlace(ctx, comm, [this, comm](Tensor *out, const int64_t *dims, char *err) {
      return stc_broadcast(comm, DataOf(out), DtypeCode(out->dtype()), out->dims(), dims, root_, err, kErrLen);
    });
  }

 private:
  int root_;
};

// Reduced over every rank, of which this rank keeps its rows of the first dimension: rows / size
// each, one more for the first rows % size ranks (as sparktrain.native.split_rows).
class ReducescatterOp : public CollectiveKernel {
 public:
  explicit ReducescatterOp(OpKernelConstruction *ctx) : CollectiveKernel(ctx, "reducescatter") {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("reduce_op", &op_));
  }

 protected:
  void Run(OpKernelContext *ctx, stc_comm *comm) override {
    const Tensor &in = ctx->input(0);
    REQUIRE(ctx, in.dims() >= 1,
                errors::InvalidArgument("reducescatter splits the first dimension and cannot take a scalar"));
    Tensor scratch;  // the engine's: its contents are unspecified afterwards
    REQUIRE_OK(ctx, ctx->allocate_temp(in.dtype(), in.shape(), &scratch));
    auto src = in.tensor_data();
    if (!src.empty()) std::memcpy(DataOf(&scratch), src.data(), src.size());
    std::vector<int64_t> dims;
    DimsOf(in.shape(), &dims);
    char err[kErrLen] = {0};
    const int64_t size = stc_comm_size(comm), rank = stc_comm_rank(comm), rows = in.dim_size(0);
    TensorShape out_shape = in.shape();
    out_shape.set_dim(0, rows / size + (rank < rows % size ? 1 : 0));
    Tensor *out = nullptr;
    REQUIRE_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    int rc = stc_reducescatter(comm, DataOf(&scratch), DataOf(out), DtypeCode(in.dtype()), op_, in.dims(),
                               dims.data(), err, sizeof err);
    REQUIRE_OK(ctx, Mapped(rc, comm, err));
  }

 private:
  int op_;
};

std::string ShapeText(const int64_t *meta) {
  int64_t ndim = meta[0], code = meta[1];
  std::string s = (code >= 0 && code <= STC_BOOL) ? std::string(kDtypeNames[code])
                                                 : "opaque" + std::to_string((code - STC_OPAQUE) * 8);
  s += "[";
  for (int64_t d = 0; d < ndim && d < kMaxDims; ++d) {
    if (d) s += ",";
    s += std::to_string(meta[2 + d]);
  }
  return s + "]";
}

// Each rank's meta row (stride values apart) against rank 0's: the same ndim, dtype and trailing
// dims, else the same FailedPrecondition on every rank (as sparktrain.native's ragged check).
Status CheckRagged(const char *what, int rank, int size, const int64_t *metas, size_t stride) {
  const int64_t *first = metas;
  for (int r = 1; r < size; ++r) {
    const int64_t *m = metas + static_cast<size_t>(r) * stride;
    if (m[0] != first[0] || m[1] != first[1] ||
        std::memcmp(m + 3, first + 3, sizeof(int64_t) * (kMaxDims - 1)) != 0)
      return errors::FailedPrecondition("rank ", rank, ": ", what, ": rank 0 passed ", ShapeText(first), " but rank ",
                                        r, " passed ", ShapeText(m), ": the ", m[1] != first[1] ? "dtypes" : "shapes",
                                        " differ (only the first dimension may differ)");
  }
  return Status();
}

// Every rank's tensor concatenated along the first dimension, which may differ between ranks:
// first every rank's [ndim, dtype, dims] (as sparktrain.native.Communicator.allgather, so a
// disagreement is the same error on every rank and never garbage), then the data.
class AllgatherOp : public CollectiveKernel {
 public:
  explicit AllgatherOp(OpKernelConstruction *ctx) : CollectiveKernel(ctx, "allgather") {}

 protected:
  void Run(OpKernelContext *ctx, stc_comm *comm) override {
    const Tensor &in = ctx->input(0);
    REQUIRE(ctx, in.dims() >= 1 && in.dims() <= kMaxDims,
                errors::InvalidArgument("allgather takes a tensor of 1 to 64 dimensions, got ", in.dims()));
    const int code = DtypeCode(in.dtype());
    std::vector<int64_t> dims;
    DimsOf(in.shape(), &dims);
    char err[kErrLen] = {0};
    const int size = stc_comm_size(comm), rank = stc_comm_rank(comm);
    int64_t meta[kMeta] = {0};
    meta[0] = in.dims();
    meta[1] = code;
    for (int d = 0; d < in.dims(); ++d) meta[2 + d] = dims[d];
    std::vector<int64_t> metas(static_cast<size_t>(size) * kMeta);
    std::vector<uint64_t> counts(size, sizeof meta);
    int64_t meta_dims[1] = {kMeta};
    int rc = stc_allgatherv(comm, meta, metas.data(), counts.data(), STC_INT64, 1, meta_dims, err, sizeof err);
    REQUIRE_OK(ctx, Mapped(rc, comm, err));
    REQUIRE_OK(ctx, CheckRagged("allgather", rank, size, metas.data(), kMeta));
    int64_t rows = 0;
    for (int r = 0; r < size; ++r) rows += metas[static_cast<size_t>(r) * kMeta + 2];
    TensorShape out_shape = in.shape();
    out_shape.set_dim(0, rows);
    Tensor *out = nullptr;
    REQUIRE_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    uint64_t row_bytes = ::tensorflow::DataTypeSize(in.dtype());
    for (int d = 1; d < in.dims(); ++d) row_bytes *= static_cast<uint64_t>(in.dim_size(d));
    for (int r = 0; r < size; ++r)
      counts[r] = static_cast<uint64_t>(metas[static_cast<size_t>(r) * kMeta + 2]) * row_bytes;
    Tensor *in_ptr = const_cast<Tensor *>(&in);
    rc = stc_allgatherv(comm, DataOf(in_ptr), DataOf(out), counts.data(), code, in.dims(), dims.data(), err,
                        sizeof err);
    REQUIRE_OK(ctx, Mapped(rc, comm, err));
  }
};

std::string ListText(const int64_t *v, int n) {
  std::string s = "[";
  for (int i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// splits[j] rows of the tensor (in order) to rank j; out: what every rank sent this one, in rank
// order, and how many rows came from each. First every rank's shape, dtype, a problem with its
// splits and the splits themselves (as sparktrain.native.Communicator.alltoall, so a bad split
// on any rank is the same error on every rank), then the data.
class AlltoallOp : public CollectiveKernel {
 public:
  explicit AlltoallOp(OpKernelConstruction *ctx) : CollectiveKernel(ctx, "alltoall") {}

 protected:
  void Run(OpKernelContext *ctx, stc_comm *comm) override {
    const Tensor &in = ctx->input(0);
    const Tensor &splits = ctx->input(1);
    REQUIRE(ctx, in.dims() <= kMaxDims,
                errors::InvalidArgument("alltoall takes a tensor of at most 64 dimensions, got ", in.dims()));
    const int code = DtypeCode(in.dtype());
    std::vector<int64_t> dims;
    DimsOf(in.shape(), &dims);
    char err[kErrLen] = {0};
    const int n = stc_comm_size(comm), rank = stc_comm_rank(comm);
    const size_t stride = kMeta + 2 + n;
    std::vector<int64_t> meta(stride, 0);
    meta[0] = in.dims();
    meta[1] = code;
    for (int d = 0; d < in.dims(); ++d) meta[2 + d] = dims[d];
    const int64_t rows = in.dims() ? in.dim_size(0) : 0;
    const int64_t given_n = splits.NumElements();
    auto sp = splits.flat<int32_t>();
    int64_t problem = 0, sum = 0;
    bool negative = false;
    if (in.dims() == 0) {
      problem = 1;
    } else if (given_n != n) {
      problem = 3;
    } else {
      for (int j = 0; j < n; ++j) {
        meta[kMeta + 2 + j] = sp(j);
        negative |= sp(j) < 0;
        sum += sp(j);
      }
      problem = negative ? 4 : (sum != rows ? 5 : 0);
    }
    meta[kMeta] = problem;
    meta[kMeta + 1] = given_n;
    std::vector<int64_t> metas(static_cast<size_t>(n) * stride);
    std::vector<uint64_t> counts(n, stride * sizeof(int64_t));
    int64_t meta_dims[1] = {static_cast<int64_t>(stride)};
    int rc = stc_allgatherv(comm, meta.data(), metas.data(), counts.data(), STC_INT64, 1, meta_dims, err, sizeof err);
    REQUIRE_OK(ctx, Mapped(rc, comm, err));
    for (int r = 0; r < n; ++r) {
      const int64_t *m = metas.data() + static_cast<size_t>(r) * stride;
      const int64_t p = m[kMeta];
      if (!p) continue;
      const int64_t *got = m + kMeta + 2;
      int64_t total = 0;
      for (int j = 0; j < n; ++j) total += got[j];
      std::string why;
      if (p == 1) why = "a scalar has no rows to send; pass an array of at least one dimension";
      else if (p == 2) why = "its " + std::to_string(m[2]) + " rows do not split evenly over " + std::to_string(n) +
                             " ranks; pass splits";
      else if (p == 3) why = "splits must be " + std::to_string(n) + " integers, one per rank (it passed " +
                             std::to_string(m[kMeta + 1]) + " values, or values that are not integers)";
      else if (p == 4) why = "splits " + ListText(got, n) + " are negative";
      else why = "splits " + ListText(got, n) + " sum to " + std::to_string(total) + ", not to its " +
                 std::to_string(m[2]) + " rows";
      REQUIRE(ctx, false, errors::FailedPrecondition("rank ", rank, ": alltoall: rank ", r, " passed ",
                                                         ShapeText(m), ": ", why));
    }
    REQUIRE_OK(ctx, CheckRagged("alltoall", rank, n, metas.data(), stride));
    uint64_t row_bytes = ::tensorflow::DataTypeSize(in.dtype());
    for (int d = 1; d < in.dims(); ++d) row_bytes *= static_cast<uint64_t>(in.dim_size(d));
    std::vector<uint64_t> sends(static_cast<size_t>(n) * n);
    Tensor *received = nullptr;
    REQUIRE_OK(ctx, ctx->allocate_output(1, TensorShape({n}), &received));
    auto rec = received->flat<int32_t>();
    int64_t out_rows = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t *sent = metas.data() + static_cast<size_t>(i) * stride + kMeta + 2;
      for (int j = 0; j < n; ++j) sends[static_cast<size_t>(i) * n + j] = static_cast<uint64_t>(sent[j]) * row_bytes;
      rec(i) = static_cast<int32_t>(sent[rank]);
      out_rows += sent[rank];
    }
    TensorShape out_shape = in.shape();
    out_shape.set_dim(0, out_rows);
    Tensor *out = nullptr;
    REQUIRE_OK(ctx, ctx->allocate_output(0, out_shape, &out));
    Tensor *in_ptr = const_cast<Tensor *>(&in);
    rc = stc_alltoallv(comm, DataOf(in_ptr), DataOf(out), sends.data(), code, in.dims(), dims.data(), err,
                       sizeof err);
    REQUIRE_OK(ctx, Mapped(rc, comm, err));
  }
};

}  // namespace

// -- ops ----------------------------------------------------------------------------------------

#define SPARKTRAIN_REDUCIBLE "{half, bfloat16, float, double, int32, int64, uint8, int8, int16, uint16, bool}"

REGISTER_OP("SparktrainAllreduce")
    .Input("tensor: T")
    .Output("reduced: T")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("reduce_op: int")
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()  // so TensorFlow keeps Unavailable (a dead peer) as it is
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);

REGISTER_OP("SparktrainGroupedAllreduce")
    .Input("tensors: N * T")
    .Output("reduced: N * T")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("N: int >= 1")
    .Attr("reduce_op: int")
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()  // so TensorFlow keeps Unavailable (a dead peer) as it is
    .SetShapeFn([](shape_inference::InferenceContext *c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return Status();
    });

REGISTER_OP("SparktrainBroadcast")
    .Input("tensor: T")
    .Output("broadcast: T")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("root: int")
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()  // so TensorFlow keeps Unavailable (a dead peer) as it is
    .SetShapeFn(::tensorflow::shape_inference::UnchangedShape);

REGISTER_OP("SparktrainAllgather")
    .Input("tensor: T")
    .Output("gathered: T")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()  // so TensorFlow keeps Unavailable (a dead peer) as it is
    .SetShapeFn([](shape_inference::InferenceContext *c) {
      shape_inference::ShapeHandle in, rest, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &in));
      TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
      c->set_output(0, out);
      return Status();
    });

REGISTER_OP("SparktrainReducescatter")
    .Input("tensor: T")
    .Output("scattered: T")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("reduce_op: int")
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](shape_inference::InferenceContext *c) {
      shape_inference::ShapeHandle in, rest, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &in));
      TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
      c->set_output(0, out);
      return Status();
    });

REGISTER_OP("SparktrainAlltoall")
    .Input("tensor: T")
    .Input("splits: int32")
    .Output("received: T")
    .Output("received_splits: int32")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn([](shape_inference::InferenceContext *c) {
      shape_inference::ShapeHandle in, rest, out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &in));
      TF_RETURN_IF_ERROR(c->Subshape(in, 1, &rest));
      TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &out));
      c->set_output(0, out);
      c->set_output(1, c->Vector(c->UnknownDim()));
      return Status();
    });

REGISTER_KERNEL_BUILDER(Name("SparktrainAllreduce").Device(::tensorflow::DEVICE_CPU), AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainGroupedAllreduce").Device(::tensorflow::DEVICE_CPU), GroupedAllreduceOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainBroadcast").Device(::tensorflow::DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainAllgather").Device(::tensorflow::DEVICE_CPU), AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainReducescatter").Device(::tensorflow::DEVICE_CPU), ReducescatterOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainAlltoall").Device(::tensorflow::DEVICE_CPU), AlltoallOp);

// -- for ctypes ---------------------------------------------------------------------------------

extern "C" {

// The engine's ABI version these kernels were compiled against.
int sparktrain_tk_abi_version(void) { return STC_ABI_VERSION; }

void sparktrain_tk_timeline(int on) { timeline_on.store(on != 0); }

// The events recorded since the last call, one per line; free with sparktrain_tk_free.
char *sparktrain_tk_timeline_drain(void) {
  std::string taken;
  {
    std::lock_guard<std::mutex> lock(timeline_mu);
    taken.swap(timeline_buf);
  }
  char *out = static_cast<char *>(std::malloc(taken.size() + 1));
  if (out) std::memcpy(out, taken.c_str(), taken.size() + 1);
  return out;
}

void sparktrain_tk_free(char *p) { std::free(p); }

// The collective timeout: how long the ranks may agree on nothing in a TensorFlow 1 graph.
void sparktrain_tk_sequencer_timeout(double seconds) { sparktrain::SequencerSetTimeout(seconds); }

// Fails the collectives waiting in the sequencer and joins its thread (shutdown()).
void sparktrain_tk_sequencer_stop(void) { sparktrain::SequencerStop(); }

}  // extern "C"
