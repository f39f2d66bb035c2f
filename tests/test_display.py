"""What a terminal would show of a rank's stream (executor/termline.py), and how the driver shows
ranks' lines, progress bars and the run's status (driver/show/display.py), without Spark or ranks."""
from __future__ import annotations

import io
import re

from sparktrain.driver.show.display import Display, sink_kind
from sparktrain.executor.termline import TermLine


def keras_like_bar(steps: int) -> str:
    """What Keras 3's Progbar writes for a terminal: each state erased with backspaces, a carriage
    return, the bold step count, then the final state and a newline."""
    out, width = "", 0
    for step in range(1, steps + 1):
        text = f"\x1b[1m{step}/{steps}\x1b[0m \x1b[32m{'━' * step}\x1b[0m - loss: {1 / step:.4f}"
        out += "\b" * width + "\r" + text
        width = len(text)
    return out + "\n"


def test_a_redrawn_bar_becomes_one_line_in_its_last_state_marked_drawn():
    term = TermLine()
    done = term.feed("Epoch 1/2\n") + term.feed(keras_like_bar(5)[:-1])
    assert done == ["Epoch 1/2"] and not done[0].drawn
    assert term.current == "5/5 ━━━━━ - loss: 0.2000"  # what a terminal shows now, without codes
    done = term.feed("\n")
    assert done == ["5/5 ━━━━━ - loss: 0.2000"] and done[0].drawn


def test_carriage_returns_utf8_and_escapes_split_between_reads():
    term = TermLine()
    data = "\r 10%|#   |\r 50%|##  |\r100%|####| done\x1b[0m\n".encode()
    lines = []
    for i in range(len(data)):  # one byte at a time: characters and codes are cut anywhere
        lines += term.feed_bytes(data[i:i + 1])
    assert lines == ["100%|####| done"] and lines[0].drawn
    assert term.close() == []


def test_a_line_longer_than_the_limit_is_split_and_an_unfinished_line_is_kept_at_the_end():
    term = TermLine(max_line=8)
    assert term.feed("abcdefghijkl") == ["abcdefgh"]
    assert term.close() == ["ijkl"]


class Tty(io.StringIO):
    def isatty(self):
        return True


def screen(raw: str) -> list[str]:
    """What a terminal shows after ``raw``: carriage returns and erase-to-end applied."""
    rows, cur, col = [], [], 0
    for token in re.findall(r"\x1b\[K|\r|\n|[^\x1b\r\n]+", raw):
        if token == "\x1b[K":
            cur = cur[:col]
        elif token == "\n":
            rows.append("".join(cur))
            cur, col = [], 0
        elif token == "\r":
            col = 0
        else:
            cur[col:col + len(token)] = list(token)
            col += len(token)
    return rows + ["".join(cur)]


def test_a_plain_stream_gets_finished_lines_only_and_the_log_the_summary(caplog):
    caplog.set_level("INFO", logger="sparktrain")
    out = io.StringIO()
    d = Display(out, out, timestamps=False, verbose=1, size=2, title="r1")
    assert sink_kind(out) == "plain"
    d.rank_up(0, "hostA")
    d.write(0, "stdout", "Epoch 1/1", 0.0)
    d.write(0, "stdout", "3/10 ━━━", 0.0, live=True)
    d.write(1, "stdout", "10/10 ━━━━━━━━━━ - loss: 0.1", 0.0, drawn=True)  # rank 1's bar: not shown
    d.write(0, "stdout", "10/10 ━━━━━━━━━━ - loss: 0.1", 0.0, drawn=True)
    d.outcome = "train finished; rank 0 returned 5 bytes pickled"
    d.finish()
    assert out.getvalue().splitlines() == ["[0]<stdout>:Epoch 1/1", "[0]<stdout>:10/10 ━━━━━━━━━━ - loss: 0.1"]
    summary = [r.getMessage() for r in caplog.records if r.name == "sparktrain.driver.show.display"]
    assert len(summary) == 1 and re.fullmatch(
        r"sparktrain r1: train finished; rank 0 returned 5 bytes pickled · 2 ranks on hostA · [\d.]+ s", summary[0])


def test_a_terminal_keeps_one_live_bottom_line_under_the_finished_lines():
    out = Tty()
    d = Display(out, out, timestamps=False, verbose=1, size=2, title="r2")
    d.rank_up(0, "hostA")
    d.rank_up(1, "hostA")
    d.write(0, "stdout", "Epoch 1/1", 0.0)
    for step in range(1, 4):
        d.write(0, "stdout", f"{step}/3 " + "━" * step, 0.0, live=True)
        d.write(1, "stdout", f"{step}/3 " + "━" * step, 0.0, live=True)  # not a shown rank's
    assert screen(out.getvalue())[-1] == "[0]<stdout>:3/3 ━━━"
    d.write(1, "stdout", "a line of rank 1", 0.0)  # printed above the bar, which is drawn again under it
    assert screen(out.getvalue())[-2:] == ["[1]<stdout>:a line of rank 1", "[0]<stdout>:3/3 ━━━"]
    d.write(0, "stdout", "3/3 ━━━ - loss: 0.1", 0.0, drawn=True)
    d.finish("done")
    shown = screen(out.getvalue())
    assert shown[shown.index("[0]<stdout>:Epoch 1/1"):-1] == [
        "[0]<stdout>:Epoch 1/1", "[1]<stdout>:a line of rank 1", "[0]<stdout>:3/3 ━━━ - loss: 0.1",
        shown[-2]] and shown[-2].startswith("sparktrain r2: done · 2 ranks on hostA (2)")
    assert shown[-1] == "" and "\b" not in out.getvalue()


def test_verbose_0_shows_no_status_or_summary():
    out = Tty()
    d = Display(out, out, timestamps=False, verbose=0, size=1)
    d.rank_up(0, "hostA")
    d.tick(force=True)
    d.write(0, "stdout", "hello", 0.0)
    d.finish("done")
    assert screen(out.getvalue()) == ["[0]<stdout>:hello", ""]


def tqdm_like_loop():
    import sys
    import time

    for done in range(0, 101, 25):
        sys.stderr.write(f"\r{done:3d}%|{'#' * (done // 25):<4}| {done}/100")
        sys.stderr.flush()
        time.sleep(0.3)  # a slow step: the task sends the bar's state between steps
    sys.stderr.write("\n")
    print("after the loop")
    return "ok"


def test_a_tqdm_style_bar_of_a_real_rank_is_live_in_a_terminal_and_one_line_in_a_file():
    import sparktrain

    tty = Tty()
    assert sparktrain.run(tqdm_like_loop, num_proc=-1, stdout=tty, stderr=tty, verbose=0) == "ok"
    raw = tty.getvalue()
    assert raw.count("\r[0]<stderr>:") >= 2 and "\b" not in raw  # drawn in place while it ran
    shown = screen(raw)
    # The two streams are read as they come: their order between each other is not fixed.
    assert sorted(shown[-3:-1]) == ["[0]<stderr>:100%|####| 100/100", "[0]<stdout>:after the loop"], shown
    assert shown[-1] == ""
    plain = io.StringIO()
    sparktrain.run(tqdm_like_loop, num_proc=-1, stdout=plain, stderr=plain, verbose=0)
    assert sorted(plain.getvalue().splitlines()) == ["[0]<stderr>:100%|####| 100/100", "[0]<stdout>:after the loop"]
