// The reducer of reducer.h: one background thread per library that uses it, started by the first
// bucket handed to it, that runs the queued collectives one at a time in the order they came,
// holding the current communicator (stc_current_acquire) for each, as a kernel on the
// executor's thread would. A collective's failure (a dead peer, a timeout, a mismatch) is its
// own op's: the engine keeps the communicator's state for the next one, as it does for kernels
// that run in place.

#include "reducer.h"

#include <pthread.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace sparktrain {
namespace {

// The thread's name, as /proc/<pid>/task/<tid>/comm shows it.
const char kReducerThread[] = "sparktrain-grad";

struct Reducer {
  std::mutex mu;
  std::condition_variable queued;
  std::deque<SequencedOp> ops;
  std::thread thread;
  bool started = false;
  bool stopping = false;
};

// Never destroyed: a process may exit with the thread still waiting.
Reducer &R() {
  static Reducer *r = new Reducer;
  return *r;
}

void ReducerLoop() {
  pthread_setname_np(pthread_self(), kReducerThread);
  Reducer &r = R();
  for (;;) {
    SequencedOp op;
    {
      std::unique_lock<std::mutex> lock(r.mu);
      r.queued.wait(lock, [&] { return r.stopping || !r.ops.empty(); });
      if (r.stopping) return;
      op = std::move(r.ops.front());
      r.ops.pop_front();
    }
    op.run(stc_current_acquire());
    stc_current_release();
    op.done();
  }
}

}  // namespace

void ReducerEnqueue(SequencedOp op) {
  Reducer &r = R();
  std::lock_guard<std::mutex> lock(r.mu);
  r.ops.push_back(std::move(op));
  if (!r.started && !r.stopping) {
    r.started = true;
    r.thread = std::thread(ReducerLoop);
  }
  r.queued.notify_all();
}

void ReducerStop() {
  Reducer &r = R();
  JoinStopping(r.mu, r.queued, r.thread, r.stopping);  // after the op in flight, if any
  std::vector<SequencedOp> left;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto &op : r.ops) left.push_back(std::move(op));
    r.ops.clear();
  }
  for (auto &op : left) {
    op.fail(STC_E_BROKEN, "shutdown() was called while this collective waited for its turn on the engine's thread");
    op.done();
  }
  std::lock_guard<std::mutex> lock(r.mu);
  r.stopping = false;
  r.started = !r.ops.empty();  // ops that came in meanwhile (after shutdown, on a new init())
  if (r.started) r.thread = std::thread(ReducerLoop);
}

}  // namespace sparktrain
