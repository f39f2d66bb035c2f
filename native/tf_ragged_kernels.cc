// sparktrain's TensorFlow kernels whose first dimension may differ between ranks: allgather and
// alltoall. Each first exchanges every rank's shape and dtype (and alltoall's splits), so that
// ranks that disagree all get the same FailedPrecondition, never garbage; then the data.
#include "tf_kernel.h"

namespace {

using namespace sparktrain_tk;

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

REGISTER_OP("SparktrainAllgather")
    .Input("tensor: T")
    .Output("gathered: T")
    .Attr("T: " SPARKTRAIN_REDUCIBLE)
    .Attr("label: string = ''")
    .Attr("sequence_key: int = -1")  // >= 0: built into a TensorFlow 1 graph (tf_sequencer.h)
    .SetIsStateful()
    .SetIsDistributedCommunication()  // so TensorFlow keeps Unavailable (a dead peer) as it is
    .SetShapeFn(RowsUnknown);

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
      TF_RETURN_IF_ERROR(RowsUnknown(c));
      c->set_output(1, c->Vector(c->UnknownDim()));  // received_splits: one per rank
      return Status();
    });

REGISTER_KERNEL_BUILDER(Name("SparktrainAllgather").Device(::tensorflow::DEVICE_CPU), AllgatherOp);
REGISTER_KERNEL_BUILDER(Name("SparktrainAlltoall").Device(::tensorflow::DEVICE_CPU), AlltoallOp);
