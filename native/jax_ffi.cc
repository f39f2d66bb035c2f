// sparktrain's XLA FFI handler for JAX on CPU: one buffer reduced in place over every rank through the
// process's current communicator (collective.h: stc_current_acquire), from inside a compiled step,
// without Python.
//
// Not built by pip (it needs jaxlib's FFI headers, jax.ffi.include_dir()): sparktrain.keras.jax_ffi
// compiles it at a rank's first use, linked against the engine library the process has loaded, and
// registers the handler with jax.ffi.register_ffi_target.
#include <cstdint>
#include <cstring>
#include <string>

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

ffi::Error Allreduce(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out, int32_t op) {
  int dtype = EngineDtype(in.element_type());
  if (dtype < 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "sparktrain allreduce: the native engine does not reduce this dtype");
  }
  if (out->untyped_data() != in.untyped_data()) {
    std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  int64_t count = static_cast<int64_t>(in.element_count());
  char err[1024] = {0};
  stc_comm *comm = stc_current_acquire();
  int rc = comm == nullptr ? STC_E_BROKEN
                           : stc_allreduce(comm, out->untyped_data(), dtype, op, 1, &count, err, sizeof err);
  stc_current_release();
  if (comm == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "sparktrain's native engine is not running in this JAX process; call "
                      "sparktrain.keras.init() on every rank first");
  }
  if (rc != STC_OK) {
    return ffi::Error(XlaCode(rc), std::string("sparktrain allreduce: ") + err);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparktrainJaxAllreduce, Allreduce,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int32_t>("op"));

// The engine ABI this handler was compiled against.
extern "C" int sparktrain_jax_ffi_abi_version(void) { return STC_ABI_VERSION; }
