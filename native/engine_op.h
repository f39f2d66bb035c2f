// One collective handed to a thread of the engine's own: the TensorFlow 1 graph sequencer's
// (tf_sequencer.h) or the gradient buckets' reducer (reducer.h). No framework here: only the engine.
#ifndef SPARKTRAIN_ENGINE_OP_H
#define SPARKTRAIN_ENGINE_OP_H

#include <functional>
#include <string>

#include "collective.h"

namespace sparktrain {

// One waiting collective. Exactly one of run and fail is called, on the thread it was handed to:
// run with the current communicator held (NULL when there is none), after which done is called
// with it released; fail with an STC_E_* code and a whole message, then done.
struct SequencedOp {
  std::function<void(stc_comm *)> run;
  std::function<void(int, const std::string &)> fail;
  std::function<void()> done;
};

}  // namespace sparktrain

#endif
