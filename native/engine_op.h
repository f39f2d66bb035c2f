// One collective handed to a thread of the engine's own: the TensorFlow 1 graph sequencer's
// (tf_sequencer.h) or the gradient buckets' reducer (reducer.h). No framework here: only the engine.
#ifndef SPARKTRAIN_ENGINE_OP_H
#define SPARKTRAIN_ENGINE_OP_H

#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

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

// The stop of a background thread (the sequencer's, the reducer's): sets stopping under mu, wakes
// the thread through cv and joins it, after what it runs now.
inline void JoinStopping(std::mutex &mu, std::condition_variable &cv, std::thread &thread, bool &stopping) {
  std::thread joined;
  {
    std::lock_guard<std::mutex> lock(mu);
    stopping = true;
    joined.swap(thread);
    cv.notify_all();
  }
  if (joined.joinable()) joined.join();
}

}  // namespace sparktrain

#endif
