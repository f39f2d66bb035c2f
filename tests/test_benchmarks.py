"""The benchmarks' shared helpers: a script's section of RESULTS.md is replaced in place,
and nothing else in the file changes; a failed contender is reported in one line and in full."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_section_is_written_then_replaced_in_place_and_the_rest_is_kept(tmp_path, capsys):
    common = _common()
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept before\n\n<!-- b:begin -->\nold\n<!-- b:end -->\n\nkept after\n")

    common.write_section(str(results), "<!-- a:begin -->", "<!-- a:end -->", "First", "what a measures", "m1",
                         "python a.py", ["contender", "x"], [["one", "1.0"], ["two", "failed: boom"]],
                         after_table=["Target met."])
    text = results.read_text()
    assert text.startswith("# Results\n\nkept before\n\n<!-- b:begin -->\nold\n<!-- b:end -->\n\nkept after\n\n")
    assert "| one | 1.0 |\n| two | failed: boom |\n\nTarget met.\n<!-- a:end -->\n" in text
    assert "wrote the section 'First' of" in capsys.readouterr().out

    common.write_section(str(results), "<!-- b:begin -->", "<!-- b:end -->", "Second", "what b measures", "m2",
                         "python b.py", ["contender", "y"], [["three|four", "2"]], before_command=["Setup."],
                         first_left=False)
    text = results.read_text()
    assert "old" not in text and text.count("<!-- b:begin -->") == 1
    assert "kept before\n\n<!-- b:begin -->\n## Second\n\nwhat b measures\n\nMachine: m2\n\nSetup.\n\n" in text
    assert "|---:|---:|\n| three/four | 2 |\n<!-- b:end -->\n\nkept after\n" in text
    assert text.count("## First") == 1 and not list(tmp_path.glob("*.tmp*"))


def test_a_failed_contender_gets_a_one_line_status_and_its_whole_traceback_on_stderr(capsys):
    common = _common()
    try:
        raise RuntimeError("outer wrapper\nValueError: the real reason | with a pipe")
    except RuntimeError as e:
        status = common.failed("peer", e, "warm-up")
    assert status == "failed: ValueError: the real reason / with a pipe"
    err = capsys.readouterr().err
    assert err.startswith("--- peer failed during warm-up; full error follows ---\nTraceback")
    assert err.rstrip().endswith("--- end of peer error ---") and "outer wrapper" in err
