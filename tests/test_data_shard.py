"""The spool and the shard without Spark: what a barrier task writes, and what a rank reads from it.

The stage's input batches are built here the way ``driver.launch.feed.stage_input`` shapes them: a feed
column, and one struct column per named DataFrame.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from sparktrain.data import layout
from sparktrain.data.shard import Shard
from sparktrain.errors import InvalidArgumentError
from sparktrain.executor import spool as spool_mod
from sparktrain.executor.spool import Spool

pytestmark = pytest.mark.timeout(60)


def stage_batches(n: int, *, val: int = 0, per_batch: int = 10, width: int = 3):
    """Batches of the stage's input: ``n`` train rows (id, x: array<float>, y), ``val`` val rows."""
    train_type = pa.struct([("id", pa.int64()), ("x", pa.list_(pa.float32())), ("y", pa.int32()),
                            ("b", pa.binary()), (layout.ROW_COLUMN, pa.int64())])
    val_type = pa.struct([("id", pa.int64()), (layout.ROW_COLUMN, pa.int64())])
    rows = [(0, i) for i in range(n)] + [(1, i) for i in range(val)]
    rng = np.random.default_rng(0)
    rng.shuffle(rows)  # the shuffle delivers rows in any order
    for start in range(0, len(rows), per_batch):
        chunk = rows[start:start + per_batch]
        train = [None if f else {"id": i, "x": [float(i)] * width, "y": i % 2, "b": bytes([i % 256]),
                                 layout.ROW_COLUMN: 1000 + i} for f, i in chunk]
        val_rows = [{"id": i, layout.ROW_COLUMN: i} if f else None for f, i in chunk]
        yield pa.RecordBatch.from_arrays(
            [pa.array([f for f, _ in chunk], pa.int8()), pa.array(train, train_type), pa.array(val_rows, val_type)],
            names=[layout.FEED_COLUMN, "train", "val"])


def spooled(tmp_path, n=50, val=7, others=((50, 7), (49, 6)), **kw) -> str:
    directory = str(tmp_path)
    rows = Spool(directory, ["train", "val"]).consume(stage_batches(n, val=val, **kw))
    assert rows == {"train": n, "val": val}
    layout.write_manifest(directory, 0, {"train": [n] + [o[0] for o in others],
                                         "val": [val] + [o[1] for o in others]})
    return directory


def test_spool_round_trip_restores_the_dataframes_order_and_columns(tmp_path):
    s = Shard(spooled(tmp_path), "train")
    rows = s.epoch_rows(0, s.rows, shuffle=False, seed=0)
    assert s.column("id").take(rows).tolist() == list(range(50))  # the row ids' order, not the arrival order
    x = s.column("x").take(rows)
    assert x.shape == (50, 3) and x.dtype == np.float32 and x[7].tolist() == [7.0] * 3
    assert s.column("b").take(rows)[:3].tolist() == [b"\x00", b"\x01", b"\x02"]
    assert s.columns == ["id", "x", "y", "b"]
    assert (s.rows, s.rows_per_rank, s.total_rows) == (50, (50, 50, 49), 149)


def test_spool_files_are_read_memory_mapped_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(spool_mod, "SPOOL_CHUNK", 200)  # several record batches per file
    directory = spooled(tmp_path, n=300, width=1000)
    before = pa.total_allocated_bytes()
    s = Shard(directory, "train")
    s.column("x")
    assert pa.total_allocated_bytes() - before < 300 * 1000 * 4 // 10  # views of the mapped file, not copies
    assert len(s._pieces) > 3
    positions = s.epoch_rows(3, 300, shuffle=True, seed=11)
    ids = s.column("id").take(positions)
    assert sorted(ids.tolist()) == list(range(300))
    assert s.column("x").take(positions)[:, 0].tolist() == ids.astype(np.float32).tolist()


def test_wrap_gives_every_rank_the_longest_shards_steps_and_covers_every_row(tmp_path):
    s = Shard(spooled(tmp_path, n=10, val=2, others=((25, 1), (3, 1))), "train")
    assert s.steps_per_epoch(4) == 7  # ceil(25 / 4)
    assert s.describe(4, "wrap").endswith("rank shards 10/25/3 rows; wrapping to 7 steps per epoch of 4 on every rank")
    ids = s.column("id").take(s.epoch_rows(0, 28, shuffle=True, seed=1)).tolist()
    assert len(ids) == 28 and set(ids[:10]) == set(range(10))  # each row once before any twice
    assert set(ids) == set(range(10))


def test_drop_stops_every_rank_at_the_shortest_shard(tmp_path):
    s = Shard(spooled(tmp_path, n=10, val=2, others=((25, 1), (9, 1))), "train")
    assert s.steps_per_epoch(4, "drop") == 2
    assert "2 steps per epoch of 4, 20 rows left out each epoch" in s.describe(4, "drop")
    with pytest.raises(InvalidArgumentError, match="shortest shard of 'train', 9 rows, which is less than one batch of 10"):
        s.steps_per_epoch(10, "drop")
    with pytest.raises(InvalidArgumentError, match="uneven must be 'wrap'.*got 'pad'"):
        s.steps_per_epoch(4, "pad")


def test_shuffle_differs_by_epoch_and_repeats_by_seed(tmp_path):
    s = Shard(spooled(tmp_path), "train")
    e0, e1 = (s.epoch_rows(e, 50, True, seed=5).tolist() for e in (0, 1))
    assert e0 != e1 and sorted(e0) == sorted(e1)
    assert s.epoch_rows(1, 50, True, seed=5).tolist() == e1
    assert s.epoch_rows(1, 50, True, seed=6).tolist() != e1


def test_bad_columns_are_named(tmp_path):
    directory = spooled(tmp_path)
    s = Shard(directory, "train")
    with pytest.raises(InvalidArgumentError, match=r"has no column 'label'; it has \['id', 'x', 'y', 'b'\]"):
        s.column("label")
    with pytest.raises(InvalidArgumentError, match=r"no DataFrame named 'test' was fed to this run; it has \['train', 'val'\]"):
        Shard(directory, "test")


def test_variable_length_arrays_and_nulls_are_refused_naming_the_column(tmp_path):
    kind = pa.struct([("x", pa.list_(pa.float32())), ("z", pa.float64()), (layout.ROW_COLUMN, pa.int64())])
    batch = pa.RecordBatch.from_arrays(
        [pa.array([0, 0], pa.int8()),
         pa.array([{"x": [1.0], "z": None, layout.ROW_COLUMN: 0}, {"x": [1.0, 2.0], "z": 1.0, layout.ROW_COLUMN: 1}],
                  kind)], names=[layout.FEED_COLUMN, "train"])
    Spool(str(tmp_path), ["train"]).consume([batch])
    layout.write_manifest(str(tmp_path), 0, {"train": [2]})
    s = Shard(str(tmp_path), "train")
    with pytest.raises(InvalidArgumentError, match="column 'x' holds arrays of lengths 1 to 2"):
        s.column("x")
    with pytest.raises(InvalidArgumentError, match=r"column 'z' has 1 null value\(s\)"):
        s.column("z")


def test_a_rank_without_rows_is_told_why(tmp_path):
    Spool(str(tmp_path), ["train"]).consume([])
    layout.write_manifest(str(tmp_path), 0, {"train": [0, 1, 1]})
    with pytest.raises(InvalidArgumentError, match=r"has 2 row\(s\), fewer than the 3 ranks, so rank 0 got none"):
        Shard(str(tmp_path), "train")
    assert not os.path.exists(os.path.join(str(tmp_path), layout.spool_file("train")))


def test_the_stage_marker_row_is_dropped(tmp_path):
    # driver.launch.feed.stage_input adds one row of no DataFrame (a null feed index, null structs) so that
    # the stage is never empty; it must not count as a row of any DataFrame, with one name or more.
    kind = pa.struct([("id", pa.int64()), (layout.ROW_COLUMN, pa.int64())])
    marker_only = pa.RecordBatch.from_arrays([pa.array([None], pa.int8()), pa.array([None], kind)],
                                             names=[layout.FEED_COLUMN, "train"])
    mixed = pa.RecordBatch.from_arrays(
        [pa.array([0, None, 0], pa.int8()),
         pa.array([{"id": 1, layout.ROW_COLUMN: 1}, None, {"id": 2, layout.ROW_COLUMN: 2}], kind)],
        names=[layout.FEED_COLUMN, "train"])
    assert Spool(str(tmp_path / "a"), ["train"]).consume([marker_only]) == {"train": 0}
    assert not os.path.exists(tmp_path / "a" / layout.spool_file("train"))
    os.mkdir(tmp_path / "b")
    assert Spool(str(tmp_path / "b"), ["train"]).consume([marker_only, mixed]) == {"train": 2}
    layout.write_manifest(str(tmp_path / "b"), 0, {"train": [2]})
    s = Shard(str(tmp_path / "b"), "train")
    assert sorted(s.column("id").take(s.epoch_rows(0, s.rows, shuffle=False, seed=0)).tolist()) == [1, 2]


def test_a_scans_row_groups_split_within_one_row_group_at_every_size():
    """Every size a run (or an elastic resize) may take: each row group goes to one rank, and two
    ranks' rows differ by at most the largest row group."""
    from sparktrain.data.layout import scan_shares
    from sparktrain.data.scan import Piece, Scan

    rng = np.random.default_rng(3)
    for trial in range(50):
        pieces = tuple(Piece(f"f{i // 4}", i % 4, int(r), 0) for i, r in enumerate(rng.integers(1, 1000, 40)))
        scan = Scan(columns=("x",), pieces=pieces)
        for size in range(1, 9):
            shares, rows = [], {}
            for rank in range(size):
                got = scan_shares([("train", scan)], size, rank, rows)["train"]["pieces"]
                shares.append([(p["path"], p["row_group"]) for p in got])
            flat = sorted(p for share in shares for p in share)
            assert flat == sorted((p.path, p.row_group) for p in pieces)  # each once
            assert all(share == sorted(share) for share in shares)  # a rank reads its own in file order
            counts = rows["train"]
            assert sum(counts) == scan.rows
            assert max(counts) - min(counts) <= max(p.rows for p in pieces), (trial, size, counts)
