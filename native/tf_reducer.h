// The engine's own thread for the collectives a tf.function hands over (tf_reducer.cc).
//
// A gradient bucket's kernel (overlap=true) does not run its collective on the TensorFlow
// executor's thread: it queues it here and returns, so the executor goes on with the rest of
// backprop while the bucket travels; the kernel's done is called from this thread once the bucket
// is reduced, and only the ops that read its outputs (the optimizer's updates of its variables)
// wait for it. Inside a tf.function every collective is a stateful op, and TensorFlow's automatic
// control dependencies run those in program order, each after the one before it has finished:
// every rank queues the same collectives in the same order, and this thread runs them in the
// order queued (first in, first out), so the ranks agree without a round of their own. The thread
// is named "sparktrain-grad". No TensorFlow here: only the engine.
#ifndef SPARKTRAIN_TF_REDUCER_H
#define SPARKTRAIN_TF_REDUCER_H

#include "tf_sequencer.h"

namespace sparktrain {

// Queues op (run, fail and done as for the sequencer: exactly one of run and fail is called, on
// this thread, then done), starting the thread if it is not running.
void ReducerEnqueue(SequencedOp op);
// Fails the queued ops (FailedPrecondition: shutdown), after the one in flight, and joins the
// thread; a later ReducerEnqueue starts it again.
void ReducerStop();

}  // namespace sparktrain

#endif
