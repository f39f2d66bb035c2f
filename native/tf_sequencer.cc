// The sequencer of tf_sequencer.h: one background thread per process, started by the first
// keyed kernel, that makes the ranks agree on which waiting collectives run, and runs them.
//
// In rounds: each rank allgathers [how many keys it has waiting, whether it has agreed on
// nothing for the timeout], then the keys themselves; the keys waiting on every rank run, lowest
// first (an op can only depend on ops built before it, so a key waiting on one rank is, or will
// be, waiting on every rank of the same step). Every rank sees the same gathered keys, so every
// rank runs the same collectives in the same order, and rounds pair with rounds. When the ranks
// have agreed on nothing for the collective timeout, every rank fails all its waiting ops in the
// same round, with a message naming what each rank waits for.
//
// The thread is the only caller of the engine while ops wait: it holds the current
// communicator (stc_current_acquire) for each round and each op, and calls an op's done with it
// released (done may start the next op of the step on this thread). A failed round (a dead
// peer, a timeout) fails every waiting op with the engine's error; an op's own failure (a
// mismatch) is that op's alone, and the engine keeps the communicator usable after it.

#include "tf_sequencer.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace sparktrain {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kErrLen = 1024;
// The longest wait between two rounds that agreed on nothing: by then, another op of the step
// may have come in on this rank.
constexpr auto kIdleRound = std::chrono::milliseconds(1);

// The thread's name, as /proc/<pid>/task/<tid>/comm shows it.
const char kThreadName[] = "sparktrain-seq";

const char kNoCommunicator[] =
    "sparktrain's native collective engine is not running in this process; call "
    "sparktrain.tensorflow.init() first (after shutdown(), init() again)";

struct Sequencer {
  std::mutex mu;  // guards all but the idle fields, which only the thread touches
  std::condition_variable arrived;
  std::map<int64_t, std::deque<SequencedOp>> waiting;
  std::thread thread;
  bool started = false;
  bool stopping = false;
  double timeout_s = 600;
  bool idle = false;  // the last round agreed on nothing
  Clock::time_point idle_since;
};

// Never destroyed: a process may exit with the thread still waiting.
Sequencer &S() {
  static Sequencer *s = new Sequencer;
  return *s;
}

void FailAll(int rc, const std::string &msg) {
  Sequencer &s = S();
  std::vector<SequencedOp> failed;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    for (auto &kv : s.waiting)
      for (auto &op : kv.second) failed.push_back(std::move(op));
    s.waiting.clear();
    s.idle = false;
  }
  for (auto &op : failed) {
    op.fail(rc, msg);
    op.done();
  }
}

std::string Named(const std::vector<int64_t> &keys) {
  if (keys.empty()) return "nothing";
  std::string s;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i) s += ", ";
    s += "op " + std::to_string(keys[i] & 0xFFFFFFFFLL) + " of graph " + std::to_string(keys[i] >> 32);
  }
  return s;
}

std::string Stuck(const std::vector<std::vector<int64_t>> &every, double timeout) {
  char secs[32];
  snprintf(secs, sizeof secs, "%g", timeout);
  std::string waits;
  for (size_t r = 0; r < every.size(); ++r)
    waits += (r ? "; rank " : "rank ") + std::to_string(r) + " waits for " + Named(every[r]);
  return std::string("the ranks waited ") + secs +
         " s for collectives of a TensorFlow 1 graph and could run none of them: " + waits +
         ". Ranks must build the same graphs in the same order, and each step must run the same collectives on "
         "every rank";
}

// Every rank's waiting keys, in rank order, and whether any rank has agreed on nothing for the
// timeout: two allgathers.
int Gather(stc_comm *comm, const std::vector<int64_t> &mine, bool idle, std::vector<std::vector<int64_t>> *every,
           bool *any_idle, std::string *msg) {
  const int size = stc_comm_size(comm);
  char err[kErrLen] = {0};
  int64_t head[2] = {static_cast<int64_t>(mine.size()), idle ? 1 : 0};
  std::vector<int64_t> heads(2 * static_cast<size_t>(size));
  std::vector<uint64_t> counts(size, sizeof head);
  int64_t dims[1] = {2};
  int rc = stc_allgatherv(comm, head, heads.data(), counts.data(), STC_INT64, 1, dims, err, sizeof err);
  if (rc == STC_OK) {
    size_t total = 0;
    *any_idle = false;
    for (int r = 0; r < size; ++r) {
      counts[r] = static_cast<uint64_t>(heads[2 * r]) * sizeof(int64_t);
      total += static_cast<size_t>(heads[2 * r]);
      *any_idle |= heads[2 * r + 1] != 0;
    }
    std::vector<int64_t> keys(std::max<size_t>(total, 1));
    int64_t none = 0;
    dims[0] = static_cast<int64_t>(mine.size());
    rc = stc_allgatherv(comm, mine.empty() ? &none : mine.data(), keys.data(), counts.data(), STC_INT64, 1, dims, err,
                        sizeof err);
    size_t at = 0;
    every->assign(size, {});
    for (int r = 0; rc == STC_OK && r < size; ++r) {
      (*every)[r].assign(keys.begin() + at, keys.begin() + at + heads[2 * r]);
      at += heads[2 * r];
    }
  }
  if (rc != STC_OK)
    *msg = "rank " + std::to_string(stc_comm_rank(comm)) + ": " + err +
           " (while the ranks agreed on which collectives of a TensorFlow 1 graph run next)";
  return rc;
}

void RunOne(int64_t key) {
  Sequencer &s = S();
  SequencedOp op;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.waiting.find(key);  // only this thread removes entries: it is there
    op = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) s.waiting.erase(it);
  }
  op.run(stc_current_acquire());
  stc_current_release();
  op.done();
}

void Round(const std::vector<int64_t> &mine, double timeout) {
  Sequencer &s = S();
  const bool idle = s.idle && std::chrono::duration<double>(Clock::now() - s.idle_since).count() > timeout;
  std::vector<std::vector<int64_t>> every;
  bool any_idle = false;
  std::string msg;
  stc_comm *comm = stc_current_acquire();
  int rc = comm ? Gather(comm, mine, idle, &every, &any_idle, &msg) : STC_E_BROKEN;
  stc_current_release();
  if (!comm) msg = kNoCommunicator;
  if (rc != STC_OK) return FailAll(rc, msg);
  std::set<int64_t> common(every[0].begin(), every[0].end());
  for (size_t r = 1; r < every.size(); ++r) {
    std::set<int64_t> both;
    for (int64_t k : every[r])
      if (common.count(k)) both.insert(k);
    common.swap(both);
  }
  if (common.empty() && any_idle) return FailAll(STC_E_TIMEOUT, Stuck(every, timeout));  // on every rank at once
  if (common.empty()) {
    if (!s.idle) {
      s.idle = true;
      s.idle_since = Clock::now();
    }
    std::unique_lock<std::mutex> lock(s.mu);
    if (s.waiting.size() == mine.size() && !s.stopping) s.arrived.wait_for(lock, kIdleRound);
    return;
  }
  s.idle = false;
  for (int64_t key : common) RunOne(key);  // ascending
}

void Loop() {
  pthread_setname_np(pthread_self(), kThreadName);
  Sequencer &s = S();
  for (;;) {
    std::vector<int64_t> mine;
    double timeout;
    {
      std::unique_lock<std::mutex> lock(s.mu);
      s.arrived.wait(lock, [&] { return s.stopping || !s.waiting.empty(); });
      if (s.stopping) return;
      for (const auto &kv : s.waiting) mine.push_back(kv.first);
      timeout = s.timeout_s;
    }
    Round(mine, timeout);
  }
}

}  // namespace

void SequencerEnqueue(int64_t key, SequencedOp op) {
  Sequencer &s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.waiting[key].push_back(std::move(op));
  if (!s.started && !s.stopping) {
    s.started = true;
    s.thread = std::thread(Loop);
  }
  s.arrived.notify_all();
}

void SequencerSetTimeout(double seconds) {
  Sequencer &s = S();
  std::lock_guard<std::mutex> lock(s.mu);
  s.timeout_s = seconds;
}

void SequencerStop() {
  Sequencer &s = S();
  JoinStopping(s.mu, s.arrived, s.thread, s.stopping);  // after the round in flight, if any
  FailAll(STC_E_BROKEN, "shutdown() was called while this collective waited for the other ranks");
  std::lock_guard<std::mutex> lock(s.mu);
  s.stopping = false;
  s.started = !s.waiting.empty();  // ops that came in meanwhile (after shutdown, on a new init())
  if (s.started) s.thread = std::thread(Loop);
}

}  // namespace sparktrain
