"""notebooks/: each one runs top to bottom in a real Jupyter kernel (nbclient), against local Spark.

The repository keeps them with their outputs cleared; a test checks that too. They run in the users'
tier (``-m "(keras2 or notebooks) and not jax and not multihost"``), beside the Horovod users' code;
06-jax runs in the JAX tier.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import uuid

import pytest

pytestmark = pytest.mark.notebooks

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = ["01-quickstart.ipynb", "02-from-horovod.ipynb", "03-custom-loop.ipynb", "04-dataframe.ipynb",
         "05-estimator.ipynb", "06-jax.ipynb", "07-tune.ipynb"]
#: The notebook each test reads; the fixture runs only those of the tests selected (the JAX tier
#: selects 06-jax alone, the base tier the others).
READS = {"test_quickstart": "01-quickstart.ipynb",
         "test_the_quickstart_cell_reads_right_in_a_browser": "01-quickstart.ipynb",
         "test_from_horovod_writes_checkpoints_to_adls_on_azurite": "02-from-horovod.ipynb", "test_custom_loop_resumes_from_its_checkpoint": "03-custom-loop.ipynb",
         "test_dataframe_trains_from_a_dataframe_with_equal_steps": "04-dataframe.ipynb",
         "test_estimator_pipeline_fits_scores_saves_and_loads": "05-estimator.ipynb",
         "test_jax_trains_on_2_ranks_and_the_driver_scores_its_model": "06-jax.ipynb",
         "test_tune_runs_two_gangs_at_once_and_prunes_with_the_keras_callback": "07-tune.ipynb"}


class Recording(nbclient.NotebookClient):
    """nbclient's client, which also keeps, per cell, the text of every display and every update of a
    display in place (``display_data``, ``update_display_data``): the notebook keeps only each
    display's last state."""

    updates: dict[int, list[str]] = {}

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] in ("display_data", "update_display_data"):
            self.updates.setdefault(cell_index, []).append(msg["content"].get("data", {}).get("text/plain", ""))
        return super().process_message(msg, cell, cell_index)


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory, azurite):
    """Every notebook that a selected test reads, in order, top to bottom in one Jupyter kernel,
    as a user working through them would: one kernel start, one Spark session, one TensorFlow
    import on the driver for all of them. Returns {name: (code cells' outputs, error or None),
    "_env": what the tests set}."""
    import nbclient.exceptions

    from sparktrain import storage

    workdir = tmp_path_factory.mktemp("notebooks")
    # The temporary files of the kernel, its Spark and the ranks go here, so that what they leave is seen.
    tmpdir = workdir / "tmp"
    tmpdir.mkdir()
    options = azurite.options()
    fs, _ = storage.filesystem("abfs://x", options)
    container = f"models-{uuid.uuid4().hex[:8]}"
    fs.mkdir(container)
    env = {"CHECKPOINT_URL": f"abfs://{container}/digits", "AZURE_STORAGE_ACCOUNT_NAME": options["account_name"],
           "AZURE_STORAGE_CONNECTION_STRING": options["connection_string"],
           "CHECKPOINT_PREFIX": f"file://{workdir}/checkpoints",
           # The "python3" kernel of this environment first, before any user-wide one; jupyter_client
           # starts it with this interpreter.
           "JUPYTER_PATH": os.path.join(sys.prefix, "share", "jupyter"), "TMPDIR": str(tmpdir)}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        first = nbformat.read(os.path.join(NOTEBOOKS, NAMES[0]), as_version=4)
        client = Recording(first, kernel_name="python3", timeout=240, startup_timeout=90,
                           resources={"metadata": {"path": str(workdir)}})
        found: dict = {"_env": env, "_workdir": workdir}
        with client.setup_kernel():
            selected = {READS.get(item.originalname) for item in request.session.items}
            for name in (n for n in NAMES if n in selected):
                nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
                # Proves which Python ran it: this virtual environment's, where sparktrain is installed.
                nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint('KERNEL', sys.executable)"))
                client.nb = nb
                client.updates = {}
                error = None
                try:
                    for index, cell in enumerate(nb.cells):
                        client.execute_cell(cell, index)
                except nbclient.exceptions.CellExecutionError as e:
                    error = e
                cells = []
                for cell in nb.cells:
                    if cell.cell_type == "code":
                        cells.append([out.text if out.output_type == "stream"
                                      else out.get("data", {}).get("text/plain", "") for out in cell.outputs])
                found[name] = (cells, error)
                found["_notebook", name] = nb
                found["_updates", name] = client.updates
        # The kernel has shut down. What the kernel keeps there itself (ipykernel_<pid>, the source of
        # its cells) is its own, and goes when it exits; the rest was left by the notebooks' code.
        found["_tmp_left"] = sorted(n for n in os.listdir(tmpdir) if not n.startswith("ipykernel_"))
    return found


def execute(executed, name: str) -> list[list[str]]:
    """Notebook ``name``'s code cells' outputs as text; its error, if a cell failed."""
    cells, error = executed[name]
    if error is not None:
        raise error
    assert "".join(cells[-1]).strip() == f"KERNEL {sys.executable}"
    return cells[:-1]


def texts(cells: list[list[str]]) -> list[str]:
    return ["".join(outputs) for outputs in cells]


def stream_lines(text: str, rank: int) -> list[str]:
    prefix = f"[{rank}]<stdout>:"
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def test_notebooks_are_stored_with_outputs_cleared():
    assert sorted(n for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb")) == NAMES
    for name in NAMES:
        nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "python3", name
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (name, cell.source[:60])


@pytest.mark.spark
@pytest.mark.timeout(600)  # the first test also runs every notebook (the module's fixture)
def test_quickstart(executed):
    cells = execute(executed, "01-quickstart.ipynb")
    outputs = texts(cells)
    at = next(i for i, o in enumerate(outputs) if "rank 0 returned a checkpoint" in o)
    train_cell = outputs[at]
    epochs = [line for line in stream_lines(train_cell, 0) if line.startswith("Epoch ")]
    assert epochs == [f"Epoch {i}/8" for i in range(1, 9)], train_cell
    # Live: the epoch lines reached the cell in several messages while it ran, not in one at its end.
    assert sum(1 for out in cells[at] if "<stdout>:Epoch " in out) >= 2, cells[at]
    # fit's default progress bar: one final line per epoch from rank 0, none from rank 1 (its bar is
    # not shown; its other lines are), never a backspace or an escape code; while it ran, the bar was
    # one display updated in place; the status table ends as the run's summary.
    assert not any(c in o for o in outputs for c in ("\b", "\x1b", "\r")), [o for o in outputs if "\b" in o][:1]
    bars = [line for line in stream_lines(train_cell, 0) if re.match(r"\s*\d+/\d+ ━+", line)]
    assert len(bars) == 8 and all(" - loss: " in line for line in bars), train_cell
    assert stream_lines(train_cell, 1)[:1] == ["Epoch 1/8"]
    assert not [line for line in stream_lines(train_cell, 1) if re.match(r"\s*\d+/\d+ ━", line)], train_cell
    updates = executed["_updates", "01-quickstart.ipynb"]
    at_index = [i for i, cell in enumerate(executed["_notebook", "01-quickstart.ipynb"].cells)
                if cell.cell_type == "code"][at]
    live = [u for u in updates.get(at_index, []) if u.startswith("[0]<stdout>:") and "━" in u]
    assert live, updates.get(at_index)  # an epoch here is about a second: a state or a few of the bar, shown in place
    assert not [u for u in updates.get(at_index, []) if u.startswith("[1]")]
    bar_displays = [o for o in executed["_notebook", "01-quickstart.ipynb"].cells[at_index].outputs
                    if o.output_type == "display_data" and "━" in o.get("data", {}).get("text/plain", "")]
    assert bar_displays == []  # every live bar was emptied when its epoch's final line came
    assert "finished" in train_cell and "rank 0 returned" in train_cell and "2 ranks" in train_cell, train_cell
    size = int(re.search(r"rank 0 returned a checkpoint of (\d+) bytes", train_cell).group(1))
    assert size > 10_000 and (executed["_workdir"] / "digits-cnn.keras").stat().st_size == size
    accuracy = float(re.search(r"test accuracy on the driver: ([\d.]+)", outputs[-1]).group(1))
    assert accuracy > 0.85, outputs[-1]


CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def page_text(dom: str) -> str:
    """The text a page shows, from its DOM (script and style left out)."""
    from html.parser import HTMLParser

    class Text(HTMLParser):
        def __init__(self):
            super().__init__()
            self.parts, self.skip = [], 0

        def handle_starttag(self, tag, attrs):
            self.skip += tag in ("script", "style")

        def handle_endtag(self, tag):
            self.skip -= tag in ("script", "style") and self.skip > 0

        def handle_data(self, data):
            if not self.skip:
                self.parts.append(data)

    parser = Text()
    parser.feed(dom)
    return "".join(parser.parts)


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_the_quickstart_cell_reads_right_in_a_browser(executed, tmp_path):
    """The executed quickstart, rendered to HTML as Jupyter shows it and opened in headless Chromium:
    the page's text holds rank 0's epoch lines, one bar line per epoch, and no backspace or escape
    code. The screenshot is kept (SPARKTRAIN_TEST_ARTIFACTS, else this test's tmp_path) for people."""
    import shutil
    import subprocess

    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed here (.ci/run installs it: apt-get install chromium)")
    from nbconvert import HTMLExporter

    execute(executed, "01-quickstart.ipynb")
    page = tmp_path / "quickstart.html"
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(executed["_notebook", "01-quickstart.ipynb"])
    page.write_text(body, encoding="utf-8")
    flags = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    text = page_text(dom)
    assert "\x1b" not in text and "\b" not in text and "[1m" not in text and "[0m" not in text
    assert [f"Epoch {i}/8" for i in range(1, 9)] == re.findall(r"\[0\]<stdout>:(Epoch \d+/8)", text)
    assert len(re.findall(r"\[0\]<stdout>:\s*\d+/\d+ ━+", text)) == 8, text[-3000:]
    assert re.search(r"finished .*rank 0 returned", text), text[-3000:]
    shots = os.environ.get("SPARKTRAIN_TEST_ARTIFACTS") or str(tmp_path)
    os.makedirs(shots, exist_ok=True)
    shot = os.path.join(shots, "quickstart-cell.png")
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1100,2600", page.as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert os.path.getsize(shot) > 10_000


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_from_horovod_writes_checkpoints_to_adls_on_azurite(executed, azurite):
    from sparktrain import storage

    options = azurite.options()
    url = executed["_env"]["CHECKPOINT_URL"]
    outputs = texts(execute(executed, "02-from-horovod.ipynb"))
    text = "\n".join(outputs)
    assert f"checkpoints go to {url}" in text
    epochs = [line for line in stream_lines(text, 0) if line.startswith("Epoch ")]
    assert epochs == [f"Epoch {i}/5" for i in range(1, 6)], text
    # Rank 0 wrote one verified checkpoint per epoch into the emulated ADLS container.
    names = [u.rsplit("/", 1)[-1] for u in storage.list_checkpoints(url, options)]
    assert names == [f"checkpoint-{i:02d}.keras" for i in range(1, 6)]
    assert storage.read_manifest(f"{url}/checkpoint-05.keras", options)["metadata"]["epoch"] == 5
    accuracy = float(re.search(r"test accuracy of the epoch-5 checkpoint, on the driver: ([\d.]+)", text).group(1))
    assert accuracy > 0.85, text


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_custom_loop_resumes_from_its_checkpoint(executed):
    prefix = executed["_env"]["CHECKPOINT_PREFIX"]
    outputs = texts(execute(executed, "03-custom-loop.ipynb"))
    first = next(o for o in outputs if "after the first run" in o)
    second = next(o for o in outputs if "after the second run" in o)
    assert [line.split(":")[0] for line in stream_lines(first, 0)] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"], first
    resumed = stream_lines(second, 0)
    # The second run picked up after epoch 3 and trained only the epochs left.
    assert resumed[0] == "resumed from epoch-03.keras after epoch 3", second
    assert [line.split(":")[0] for line in resumed[1:]] == ["epoch 4/6", "epoch 5/6", "epoch 6/6"], second
    losses = [float(line.rsplit(" ", 1)[1]) for line in stream_lines(first, 0) + resumed[1:]]
    assert losses[-1] < losses[0], losses
    from sparktrain import storage

    names = [u.rsplit("/", 1)[-1] for u in storage.list_checkpoints(prefix)]
    assert names == [f"epoch-{i:02d}.keras" for i in range(1, 7)]
    accuracy = float(re.search(r"test accuracy on the driver: ([\d.]+)", outputs[-1]).group(1))
    assert accuracy > 0.85, outputs[-1]


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_dataframe_trains_from_a_dataframe_with_equal_steps(executed):
    outputs = texts(execute(executed, "04-dataframe.ipynb"))
    text = "\n".join(outputs)
    shards = re.search(r"'train' rank shards (\d+)/(\d+) rows; wrapping to (\d+) steps per epoch of 32", text)
    assert shards, text
    rows = [int(n) for n in shards.groups()[:2]]
    assert max(rows) - min(rows) <= 1 and 1300 < sum(rows) < 1580  # about 80% of 1797 digits, dealt evenly
    steps = int(shards.group(3))
    assert steps == -(-max(rows) // 32)
    assert f"rank 0: {rows[0]} training rows, {steps} steps per epoch" in text
    epochs = [line for line in stream_lines(text, 0) if line.startswith("Epoch ")]
    assert epochs == [f"Epoch {i}/8" for i in range(1, 9)], text
    accuracy = float(re.search(r"validation accuracy, averaged over the ranks: ([\d.]+)", text).group(1))
    assert accuracy > 0.85, text


@pytest.mark.spark
@pytest.mark.jax
@pytest.mark.timeout(600)
def test_jax_trains_on_2_ranks_and_the_driver_scores_its_model(executed):
    if importlib.util.find_spec("jax") is None:  # not imported: jax sets TF_CPP_MIN_LOG_LEVEL in this process
        pytest.skip("06-jax.ipynb needs jax: pip install sparktrain[jax]")
    text = "\n".join(texts(execute(executed, "06-jax.ipynb")))
    assert "'train' rank shards" in text and "steps per epoch of 32 on every rank" in text, text
    assert "saved by rank 0: digits-jax.keras" in text, text
    accuracy = float(re.search(r"test accuracy on the driver: ([\d.]+)", text).group(1))
    assert accuracy > 0.85, text
    assert "[Gloo]" not in text, text


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_estimator_pipeline_fits_scores_saves_and_loads(executed):
    outputs = texts(execute(executed, "05-estimator.ipynb"))
    text = "\n".join(outputs)
    epochs = [line for line in stream_lines(text, 0) if line.startswith("Epoch ")]
    assert epochs == [f"Epoch {i}/6" for i in range(1, 7)], text
    assert re.search(r"validation accuracy after 6 epochs: ([\d.]+)", text), text
    accuracy = float(re.search(r"test accuracy of the scored DataFrame: ([\d.]+)", text).group(1))
    assert accuracy > 0.85, text
    assert "identical predictions after loading: True" in text, text
    store = executed["_workdir"] / "models"
    runs = [p.name for p in store.iterdir()]
    assert len(runs) == 1 and (store / runs[0] / "model.keras").is_file(), runs


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_the_notebooks_leave_no_temporary_files(executed):
    """What the notebooks teach cleans up after itself: the ranks' train functions keep their
    model files in temporary directories that go when they are done."""
    assert executed["_tmp_left"] == [], executed["_tmp_left"]


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_tune_runs_two_gangs_at_once_and_prunes_with_the_keras_callback(executed):
    """07-tune: a study of 4 trials of the digits CNN, 2 ranks each, 2 at once; Optuna's own Keras
    pruning callback on the ranks prunes the queued poor guess; the cell's table was updated in place."""
    name = "07-tune.ipynb"
    outputs = texts(execute(executed, name))
    summary = outputs[-1]
    counts = eval(re.search(r"trials: (\{.*\})", summary).group(1))  # noqa: S307 - the notebook's own dict
    assert counts.get("COMPLETE", 0) >= 2 and counts.get("PRUNED", 0) >= 1 and sum(counts.values()) == 4, summary
    assert "the first two trials ran at the same time: True" in summary
    epochs = eval(re.search(r"epochs each pruned trial reported: (\{.*\})", summary).group(1))  # noqa: S307
    # The queued poor guess (trial 2, lr=1e-5) is pruned and its gang stopped before the last of 4 epochs.
    # The fourth trial is the sampler's own guess: it may be pruned too, at any epoch, its last included.
    assert epochs.get(2, 4) < 4, summary
    best = float(re.search(r"val_accuracy ([\d.]+)", summary).group(1))
    assert best > 0.9, summary
    # The study's table: one display, updated in place while the trials ran, ending with every trial.
    at = [i for i, cell in enumerate(executed["_notebook", name].cells)
          if cell.cell_type == "code" and "tune.optimize(" in cell.source]
    tables = [u for u in executed["_updates", name].get(at[0], []) if u.startswith("sparktrain.tune: study")]
    assert len(tables) >= 4 and "2 running" in "".join(tables), tables[:3]
    assert tables[-1].startswith("sparktrain.tune: study digits-cnn (maximize), 0 running, 4 ended"), tables[-1]
