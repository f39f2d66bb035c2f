// The order of the TensorFlow kernels' collectives in a TensorFlow 1 graph (tf_sequencer.cc).
//
// A session runs the ops of a step that do not depend on each other in any order, even at once,
// so two ranks could pair different collectives. Each kernel built into such a graph carries a
// key (sparktrain.tensorflow.backends.sequence.key_for: the graph's number << 32 | the op's number
// in it), the same on every rank that builds the same graphs in the same order. Such a kernel
// hands its collective to this process's sequencer and returns at once, leaving the session's
// thread free; one background thread makes the ranks agree, in rounds, which keys run next (the
// keys waiting on every rank, lowest first) and runs them; it is named "sparktrain-seq". No
// TensorFlow here: only the engine.
#ifndef SPARKTRAIN_TF_SEQUENCER_H
#define SPARKTRAIN_TF_SEQUENCER_H

#include <cstdint>

#include "engine_op.h"

namespace sparktrain {

// Queues op under key, starting the sequencer's thread if it is not running.
void SequencerEnqueue(int64_t key, SequencedOp op);
// Seconds the ranks may agree on nothing before every rank fails its waiting ops.
void SequencerSetTimeout(double seconds);
// Fails every waiting op (FailedPrecondition: shutdown) and joins the thread; a later
// SequencerEnqueue starts it again.
void SequencerStop();

}  // namespace sparktrain

#endif
