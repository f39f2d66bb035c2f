// The engine's own thread for gradient buckets (reducer.cc), shared by the TensorFlow kernels
// (tf_kernel.h) and the XLA FFI handler for JAX (jax_ffi.cc); each library has its own.
//
// A gradient bucket's collective does not run on the framework's thread: its kernel (a TensorFlow
// op built with overlap=true, or the JAX handler's bucket custom call) queues it here and returns,
// so the framework goes on with the rest of backprop while the bucket travels; the op's done is
// called from this thread once the bucket is reduced, and only what reads the bucket's outputs
// (the optimizer's updates of its variables) waits for it. The frameworks hand the buckets over in
// program order, each once the one before it has finished (TensorFlow: the automatic control
// dependencies of a tf.function's stateful ops; JAX: each bucket's custom call reads the one
// before it's result): every rank queues the same collectives in the same order, and this thread
// runs them in the order queued (first in, first out), so the ranks agree without a round of their
// own. The thread is named "sparktrain-grad". No framework here: only the engine.
#ifndef SPARKTRAIN_REDUCER_H
#define SPARKTRAIN_REDUCER_H

#include "engine_op.h"

namespace sparktrain {

// Queues op (run, fail and done as engine_op.h says: exactly one of run and fail is called, on
// this thread, then done), starting the thread if it is not running.
void ReducerEnqueue(SequencedOp op);
// Fails the queued ops (FailedPrecondition: shutdown), after the one in flight, and joins the
// thread; a later ReducerEnqueue starts it again.
void ReducerStop();

}  // namespace sparktrain

#endif
