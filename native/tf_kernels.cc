// TensorFlow CPU kernels over sparktrain's collective engine (collective.h).
//
// With tf_ragged_kernels.cc and tf_kernel.h, the only files of native/ that include TensorFlow:
// sparktrain.tensorflow.kernels compiles them at first use (pip builds the package without
// TensorFlow) into one library and loads it with tf.load_op_library. It links against the
// engine library that sparktrain.native loaded with ctypes, by its path, so the process holds
// one engine and the kernels find the communicator that sparktrain.tensorflow.init() brought up
// through stc_current_acquire(). Each kernel runs one collective while holding the engine's
// current-communicator lock: kernels run one at a time, and shutdown() waits for the one in
// flight before the communicator goes away. Kernels built into a TensorFlow 1 graph carry a
// sequence_key and run on the sequencer's thread, in the order the ranks agree on
// (tf_sequencer.h); shutdown() stops it first.
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
//
// This file: the kernels whose tensors have the same shape on every rank (tf_kernel.h has what
// they share with tf_ragged_kernels.cc), their ops, and the functions sparktrain.tensorflow.kernels
// calls with ctypes.
#include "tf_kernel.h"

namespace {

using namespace sparktrain_tk;

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

}  // namespace

// -- ops ----------------------------------------------------------------------------------------

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
    .Attr("overlap: bool = false")    // a gradient bucket: reduced on the engine's thread (reducer.h)
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

REGISTER_OP("SparktrainReducescatter")
    .Input("tensor: T")
    .Output("scattered: T")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("reduce_op: int")
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()
    .SetShapeFn(RowsUnknown);

REGISTER_KERNEL_BUILDER(Name("SparktrainAllreduce").Device(::tensorflow::DEVICE_CPU), AllreduceOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainGroupedAllreduce").Device(::tensorflow::DEVICE_CPU), GroupedAllreduceOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainBroadcast").Device(::tensorflow::DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainReducescatter").Device(::tensorflow::DEVICE_CPU), ReducescatterOp);

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

// Fails the collectives waiting in the sequencer and on the engine's thread, and joins both
// threads (shutdown()).
void sparktrain_tk_sequencer_stop(void) {
  sparktrain::ReducerStop();
  sparktrain::SequencerStop();
}

}  // extern "C"
