"""``sparktrain.HorovodRunner``, sparkdl's runner: bad arguments refused in the constructor; real runs
in local mode (``np < 0``) and on a real ``local[2]`` Spark (``np > 0``)."""
from __future__ import annotations

import os
import time

import pytest

import sparktrain
from conftest import module_spark
from helpers import read_ranks, record_rank

pytestmark = pytest.mark.timeout(120)

spark = module_spark("local[2]")


@pytest.mark.parametrize("kwargs, match", [
    ({"np": 0}, r"np must not be 0, got 0: pass np=N \(N > 0\) for N ranks .* np=-N for N processes on the driver"),
    ({"np": 2.0}, r"np must be an int, got 2\.0 \(float\): np=N runs N ranks"),
    ({"np": "2"}, r"np must be an int, got '2' \(str\)"),
    ({"np": True}, r"np must be an int, got True \(bool\)"),
    ({"np": None}, r"np must be an int, got None \(NoneType\)"),
    ({"np": 2, "driver_log_verbosity": "verbose"},
     r"driver_log_verbosity must be 'all' \(every rank's output in the cell\) or 'log_callback_only' "
     r"\(rank 0's\), got 'verbose'"),
    ({"np": -2, "driver_log_verbosity": None}, r"driver_log_verbosity must be .*, got None"),
])
def test_bad_arguments_are_refused_in_the_constructor_with_the_value(kwargs, match):
    started = time.monotonic()
    with pytest.raises(sparktrain.InvalidArgumentError, match=match):
        sparktrain.HorovodRunner(**kwargs)
    assert time.monotonic() - started < 5  # refused on the spot, nothing started


def test_np_and_driver_log_verbosity_are_keyword_only_and_main_must_be_callable():
    with pytest.raises(TypeError, match="positional"):
        sparktrain.HorovodRunner(2)  # as sparkdl's: HorovodRunner(np=2)
    with pytest.raises(TypeError, match="np"):
        sparktrain.HorovodRunner()
    hr = sparktrain.HorovodRunner(np=-2)
    assert (hr.num_processor, hr.driver_log_verbosity) == (-2, "log_callback_only")  # sparkdl's default
    with pytest.raises(sparktrain.InvalidArgumentError, match=r"needs the training function first, a callable, "
                                                              r"got 'train' \(str\): hr\.run\(main, \*\*kwargs\)"):
        hr.run("train", lr=0.1)


def greet(outdir, scale, word="hi"):
    import sparktrain

    info = record_rank(outdir, scale=scale, word=word)
    print(f"rank {info['rank']} of {info['size']} says {word}")
    return scale * 10 + sparktrain.rank()


def test_negative_np_runs_that_many_processes_on_the_driver(tmp_path, capsys):
    """sparkdl's local mode: every rank's output in the cell even under the default verbosity."""
    value = sparktrain.HorovodRunner(np=-2).run(greet, outdir=str(tmp_path), scale=4, word="hello")
    assert value == 40  # rank 0's
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1]
    assert {(r["size"], r["scale"], r["word"]) for r in ranks.values()} == {(2, 4, "hello")}
    # Processes on this machine (local mode's loopback address), each a process of its own.
    assert {r["env"]["MASTER_ADDR"] for r in ranks.values()} == {"127.0.0.1"}
    assert ranks[0]["pid"] != ranks[1]["pid"] and os.getpid() not in (ranks[0]["pid"], ranks[1]["pid"])
    lines = sorted(line for line in capsys.readouterr().out.splitlines() if "says" in line)
    assert lines == ["[0]<stdout>:rank 0 of 2 says hello", "[1]<stdout>:rank 1 of 2 says hello"]


def fail_on_rank_1(outdir):
    import sparktrain

    record_rank(outdir)
    print(f"rank {sparktrain.rank()} reading its shard")
    if sparktrain.rank() == 1:
        raise ValueError("shard 1 is empty")
    return "done"


@pytest.mark.spark
def test_positive_np_runs_a_barrier_stage_showing_the_output_that_driver_log_verbosity_picks(spark, tmp_path, capsys):
    value = sparktrain.HorovodRunner(np=2).run(greet, outdir=str(tmp_path), scale=3)
    assert value == 30
    ranks = read_ranks(str(tmp_path))
    assert sorted(ranks) == [0, 1] and {r["word"] for r in ranks.values()} == {"hi"}  # main's own default
    assert {r["env"]["SPARKTRAIN_SIZE"] for r in ranks.values()} == {"2"}
    # "log_callback_only" (the default): rank 0's output alone.
    assert [line for line in capsys.readouterr().out.splitlines() if "says" in line] == [
        "[0]<stdout>:rank 0 of 2 says hi"]

    # A failed rank's traceback and last lines come with the error, though its output was not shown.
    (tmp_path / "f").mkdir()
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.HorovodRunner(np=2, driver_log_verbosity="log_callback_only").run(fail_on_rank_1,
                                                                                     outdir=str(tmp_path / "f"))
    root = e.value.root_cause
    assert (root.rank, root.exc_type.rsplit(".", 1)[-1], root.message) == (1, "ValueError", "shard 1 is empty")
    assert "rank 1 reading its shard" in root.output_tail and "fail_on_rank_1" in root.traceback
    assert "[1]<stdout>" not in capsys.readouterr().out

    # "all": every rank's.
    assert sparktrain.HorovodRunner(np=2, driver_log_verbosity="all").run(greet, outdir=str(tmp_path), scale=5) == 50
    assert sorted(line for line in capsys.readouterr().out.splitlines() if "says" in line) == [
        "[0]<stdout>:rank 0 of 2 says hi", "[1]<stdout>:rank 1 of 2 says hi"]
