"""The protocol between driver and ranks: every message round-trips through its one encoding, in
the JSON shape the channel has always carried; anything else is refused with an error that names
what is wrong; a failure carried in a task's error comes back out of foreign text."""
import json
import pickle

import pytest

from sparktrain.seam import protocol
from sparktrain.errors import RankFailure
from sparktrain.seam.protocol import RANK, DRIVER, ProtocolError

pytestmark = pytest.mark.timeout(30)

FAILURE = RankFailure(rank=2, host="10.0.0.7", local_rank=1, exc_type="ValueError", message="bad shard",
                      traceback="Traceback ...\nValueError: bad shard", exitcode=1, output_tail=("epoch 1", "épo 2"),
                      time=1700000000.5, retryable=False)

#: One sample of every message, with who sends it, and the JSON object the channel carries for it.
SAMPLES = [
    (RANK, protocol.CheckedIn(rank=1, host="10.0.0.7", port=41000, master_port=0, pid=77, partition=2,
                          shard={"train": 12}),
     {"type": "hello", "rank": 1, "host": "10.0.0.7", "port": 41000, "master_port": 0, "pid": 77, "partition": 2,
      "shard": {"train": 12}}),
    (RANK, protocol.CheckedIn(rank=0, host="h", port=1, master_port=2, pid=3, collective_key="ab" * 32),
     {"type": "hello", "rank": 0, "host": "h", "port": 1, "master_port": 2, "pid": 3, "partition": -1, "shard": {},
      "collective_key": "ab" * 32}),
    (RANK, protocol.Output("stderr", "loss 0.25 \u2713", 1700000000.25),
     {"type": "out", "stream": "stderr", "line": "loss 0.25 \u2713", "time": 1700000000.25}),
    (RANK, protocol.Beat(), {"type": "beat"}),
    (RANK, protocol.Beat({"n": 4, "active": True, "what": "allreduce", "shape": [1024]}),
     {"type": "beat", "at": {"n": 4, "active": True, "what": "allreduce", "shape": [1024]}}),
    (RANK, protocol.Quiet(), {"type": "quiet"}),
    (RANK, protocol.CheckedIn(rank=2, host="h", port=1, master_port=0, pid=3, session="5e" * 16),
     {"type": "hello", "rank": 2, "host": "h", "port": 1, "master_port": 0, "pid": 3, "partition": -1, "shard": {},
      "session": "5e" * 16}),
    (RANK, protocol.Bye(), {"type": "bye"}),
    (RANK, protocol.Resume(rank=1, attempt=2, session="ab" * 16, away=1.5),
     {"type": "resume", "rank": 1, "attempt": 2, "session": "ab" * 16, "away": 1.5}),
    (RANK, protocol.Stacks('File "train.py", line 3 in wait'),
     {"type": "stacks", "text": 'File "train.py", line 3 in wait'}),
    (RANK, protocol.RankFailed(FAILURE), {"type": "failed", "failure": {**FAILURE.__dict__, "output_tail": list(
        FAILURE.output_tail)}}),
    (DRIVER, protocol.Peers(("a", "b"), (1000, 1001), 9, ({"train": 3}, {"train": 4})),
     {"type": "peers", "hosts": ["a", "b"], "ports": [1000, 1001], "master_port": 9,
      "shards": [{"train": 3}, {"train": 4}]}),
    (DRIVER, protocol.Beat(), {"type": "beat"}),
    (DRIVER, protocol.AskStacks(), {"type": "stacks"}),
    (DRIVER, protocol.Resumed(), {"type": "resumed"}),
    (DRIVER, protocol.Abort("rank 1 failed"), {"type": "abort", "reason": "rank 1 failed"}),
    # A sparktrain.tune trial's rank and the study (tune/rank.py, tune/server.py).
    (RANK, protocol.TrialHello(3, 1), {"type": "trial", "number": 3, "rank": 1}),
    (RANK, protocol.Suggest("lr", "suggest_float", '{"low": 0.1, "high": 1.0}'),
     {"type": "suggest", "name": "lr", "method": "suggest_float", "args": '{"low": 0.1, "high": 1.0}'}),
    (RANK, protocol.Report(2, 0.5), {"type": "report", "step": 2, "value": 0.5}),
    (RANK, protocol.ShouldPrune(-1), {"type": "prune?", "step": -1}),
    (RANK, protocol.SetUserAttr("k", "[1, 2]"), {"type": "attr", "key": "k", "value": "[1, 2]"}),
    (RANK, protocol.Look("params"), {"type": "look", "what": "params"}),
    (DRIVER, protocol.Answer("0.25"), {"type": "answer", "value": "0.25"}),
    (DRIVER, protocol.Answer(error="ValueError: no"), {"type": "answer", "value": "null", "error": "ValueError: no"}),
]


def test_every_message_round_trips_in_the_channels_json_shape():
    covered = set()
    for sender, msg, wire in SAMPLES:
        body = protocol.encode(msg)
        assert body == json.dumps(wire, separators=(",", ":")).encode(), msg  # compact, as the channel sent it
        again = protocol.decode(body, sender)
        assert again == msg and type(again) is type(msg)
        covered.add((sender, type(msg)))
    every = {(sender, kind.cls) for sender, kinds in protocol._SENT_BY.items() for kind in kinds.values()}
    assert covered == every, every - covered  # a new message needs a sample here
    assert protocol.decode(protocol.encode(protocol.RankFailed(FAILURE)), RANK).failure.output_tail == ("epoch 1", "épo 2")


def test_one_tag_means_what_its_sender_may_send():
    assert protocol.decode(b'{"type":"stacks","text":"x"}', RANK) == protocol.Stacks("x")
    assert protocol.decode(b'{"type":"stacks"}', DRIVER) == protocol.AskStacks()
    # A number where a float is due is the float; fields a message does not know are ignored.
    assert protocol.decode(b'{"type":"out","stream":"stdout","line":"x","time":3,"later":1}', RANK) == \
        protocol.Output("stdout", "x", 3.0)


@pytest.mark.parametrize("sender, body, says", [
    (RANK, b"not json", "a message from a rank is not JSON"),
    (RANK, b"\xff\xfe", "a message from a rank is not JSON"),
    (RANK, b"[1, 2]", "a rank sent a message of a JSON list; a rank sends only attr, beat, bye, failed, hello, look, out, "
                       "prune?, quiet, report, resume, stacks, suggest, trial"),
    (RANK, b'{"rank": 0}', "a rank sent a message of type 'None'"),
    (RANK, b'{"type": ["hello"]}', "a rank sent a message of type \"['hello']\""),
    (RANK, b'{"type": "shutdown"}', "a rank sent a message of type 'shutdown'; a rank sends only"),
    (RANK, b'{"type": "abort", "reason": "x"}', "a rank sent a message of type 'abort'"),
    (RANK, b'{"type": "peers", "hosts": [], "ports": [], "master_port": 1, "shards": []}', "of type 'peers'"),
    (DRIVER, b'{"type": "out", "stream": "stdout", "line": "x", "time": 1}',
     "a driver sent a message of type 'out'; a driver sends only abort, answer, beat, peers, resumed, stacks"),
    (DRIVER, b'{"type": "failed", "failure": {}}', "a driver sent a message of type 'failed'"),
    (RANK, b'{"type": "hello", "rank": 0, "host": "h", "port": 1, "pid": 1}',
     "a rank's 'hello' message lacks its field 'master_port'"),
    (RANK, b'{"type": "hello", "rank": "0", "host": "h", "port": 1, "master_port": 1, "pid": 1}',
     "a rank's 'hello' message has rank='0'; it must be an int"),
    (RANK, b'{"type": "hello", "rank": true, "host": "h", "port": 1, "master_port": 1, "pid": 1}',
     "a rank's 'hello' message has rank='True'; it must be an int"),
    (RANK, b'{"type": "hello", "rank": 0, "host": "h", "port": 1, "master_port": 1, "pid": 1, "shard": [1]}',
     "has shard='[1]'; it must be an object"),
    (RANK, b'{"type": "out", "stream": "stdout", "line": null, "time": 1}', "has line='None'; it must be a str"),
    (RANK, b'{"type": "out", "stream": "stdout", "line": "x", "time": "now"}', "has time='now'; it must be a number"),
    (RANK, b'{"type": "beat", "at": 3}', "a rank's 'beat' message has at='3'; it must be an object"),
    (RANK, b'{"type": "stacks"}', "a rank's 'stacks' message lacks its field 'text'"),
    (RANK, b'{"type": "failed", "failure": {"rank": 1, "host": "h"}}',
     "it must be a failure report with an int rank, a str host and an int local_rank"),
    (RANK, b'{"type": "failed", "failure": "rank 1 died"}', "it must be a failure report"),
    (DRIVER, b'{"type": "peers", "hosts": ["a"], "ports": ["1"], "master_port": 1, "shards": [{}]}',
     "a driver's 'peers' message has ports=\"['1']\"; it must be a list of int"),
    (DRIVER, b'{"type": "abort"}', "a driver's 'abort' message lacks its field 'reason'"),
    (RANK, b'{"type": "resume", "rank": 0, "attempt": 1}', "a rank's 'resume' message lacks its field 'session'"),
])
def test_anything_else_is_refused_naming_what_is_wrong(sender, body, says):
    with pytest.raises(ProtocolError) as e:
        protocol.decode(body, sender)
    assert says in str(e.value)
    assert isinstance(e.value, ValueError)  # what the channel's readers already catch


def test_peers_answer_every_hello_in_rank_order():
    hellos = [protocol.CheckedIn(rank=r, host=f"h{r}", port=1000 + r, master_port=900 if r == 0 else 0, pid=r,
                             shard={"x": r}) for r in (2, 0, 1)]
    assert protocol.peers(hellos) == protocol.Peers(("h0", "h1", "h2"), (1000, 1001, 1002), 900,
                                                    ({"x": 0}, {"x": 1}, {"x": 2}))
    with pytest.raises(ProtocolError, match="a rank sent a 'beat' message where every rank says hello"):
        protocol.peers(hellos + [protocol.Beat()])


def test_a_failure_carried_in_a_tasks_error_comes_back_out_of_foreign_text():
    carried = protocol.RankError(FAILURE)
    assert str(carried).startswith("sparktrain rank 2 (local rank 1 on 10.0.0.7): ValueError: bad shard\n")
    other = RankFailure(rank=0, host="h", local_rank=0, exitcode=-9, time=5.0)
    # Spark wraps the task's error in its own text, around and between the reports.
    spark_text = (f"py4j: An error occurred\nJob aborted due to stage failure: ... {carried}\n  at org.apache.spark..."
                  f"\n{protocol.RankError(other)}\n{protocol.RankError(RankFailure(rank=2, host='x', local_rank=0))}")
    assert protocol.failures_in(spark_text) == [FAILURE, other]  # the first report of each rank
    assert protocol.failures_in("no report here") == []
    assert protocol.failures_in("SPARKTRAIN-FAILURE:bm90IGpzb24=:END") == []  # decodes to no message: passed over
    # Told on the channel already: the error carries no report, only the headline.
    told = protocol.RankError(FAILURE, carry_report=False)
    assert protocol.failures_in(str(told)) == [] and str(told) == f"sparktrain {FAILURE.headline()}"
    for err in (carried, told):
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is protocol.RankError and str(again) == str(err) and again.failure == FAILURE
