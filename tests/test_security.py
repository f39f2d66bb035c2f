"""Security of a real run on local[3]: the driver channel admits only holders of the run's secret,
binds to the driver's address and closes with the run; the secret leaks nowhere; an executor
with other versions than the driver fails at once with a readable diff.
"""
from __future__ import annotations

import base64
import io
import logging
import os
import socket
import threading

import psutil
import pytest

import sparktrain
from helpers import read_ranks, record_rank, wait_for_file
from sparktrain.seam import channel, protocol
from conftest import module_spark

pytestmark = [pytest.mark.spark, pytest.mark.timeout(120)]


spark = module_spark("local[3]")


def _listening_ports() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}


def _listening_addresses() -> dict[int, str]:
    return {c.laddr.port: c.laddr.ip for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def wait_then_answer(outdir):
    import sparktrain

    record_rank(outdir)
    wait_for_file(os.path.join(outdir, "go"), timeout=90)
    return f"rank {sparktrain.rank()} undisturbed"


def _closed_by_server(sock: socket.socket) -> bool:
    """True when the server drops the connection (EOF or reset) within the socket's timeout."""
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_strangers_are_refused_and_the_run_goes_on(spark, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="sparktrain")
    outdir = str(tmp_path)
    before = _listening_ports()
    probes: dict[str, bool] = {}
    found: dict[str, object] = {}

    def probe():
        try:
            for r in range(3):
                wait_for_file(os.path.join(outdir, f"rank-{r}.json"), timeout=60)
            (port,) = _listening_ports() - before  # the run's channel: the one new listener
            found["port"] = port
            found["ip"] = _listening_addresses()[port]
            address = (found["ip"], port)
            with socket.create_connection(address, timeout=15) as raw:
                raw.recv(64)  # the greeting
                raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # not a frame at all
                probes["garbage"] = _closed_by_server(raw)
            with socket.create_connection(address, timeout=15) as raw:
                raw.recv(64)
                body = b'{"type":"hello","rank":0,"host":"evil","port":1,"master_port":1,"pid":1}'
                raw.sendall(len(body).to_bytes(4, "big") + b"\x00" * 32 + body)  # no credentials: a zero MAC
                probes["no credentials"] = _closed_by_server(raw)
            bad = channel.connect(address, b"wrong secret".ljust(32, b"!"), timeout=15)
            bad.send(protocol.CheckedIn(rank=1, host="evil", port=1, master_port=1, pid=1))
            bad.sock.settimeout(15)
            probes["wrong secret"] = _closed_by_server(bad.sock)
            bad.close()
        finally:
            open(os.path.join(outdir, "go"), "w").close()

    t = threading.Thread(target=probe)
    t.start()
    try:
        result = sparktrain.run(wait_then_answer, args=(outdir,), num_proc=3, verbose=0)
    finally:
        t.join(60)
    assert probes == {"garbage": True, "no credentials": True, "wrong secret": True}
    assert result == "rank 0 undisturbed"
    assert len(read_ranks(outdir)) == 3
    assert caplog.text.count("refused a connection") == 3
    # Bound to the driver's address, and closed when the run ended.
    assert found["ip"] == spark.sparkContext.getConf().get("spark.driver.host")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((found["ip"], found["port"]), timeout=5).close()


def dump_environment(outdir):
    import os

    import sparktrain

    record_rank(outdir, environ=dict(os.environ))
    if sparktrain.rank() == 1:
        raise RuntimeError("fail on purpose, to get an error message to search")


def test_the_secret_appears_in_no_log_error_job_description_or_environment(spark, tmp_path, caplog, monkeypatch):
    secrets = []
    real = channel.new_secret

    def recording_new_secret():
        secrets.append(real())
        return secrets[-1]

    monkeypatch.setattr(channel, "new_secret", recording_new_secret)
    caplog.set_level(logging.DEBUG, logger="sparktrain")
    out, err = io.StringIO(), io.StringIO()
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(dump_environment, args=(str(tmp_path),), num_proc=3, verbose=2, stdout=out, stderr=err)
    assert len(secrets) == 1
    secret = secrets[0]
    forms = [secret.hex(), base64.b64encode(secret).decode(), repr(secret)[2:-1], secret.hex().upper()]
    store = spark.sparkContext._jsc.sc().statusStore().jobsList(None)
    descriptions = " ".join(str(store.apply(i).description()) for i in range(store.size()))
    assert "sparktrain.run(dump_environment) num_proc=3" in descriptions
    environments = " ".join(str(r["environ"]) for r in read_ranks(str(tmp_path)).values())
    assert "SPARKTRAIN_RUN_ID" in environments
    for where, text in [("log", caplog.text), ("output", out.getvalue() + err.getvalue()),
                        ("error", str(e.value)), ("job description", descriptions),
                        ("rank environment", environments)]:
        for form in forms:
            assert form not in text, f"the run's secret appears in the {where}"


def test_an_executor_with_other_versions_fails_at_once_with_a_diff(spark, monkeypatch):
    from sparktrain.seam import versions

    real = versions.collect()
    driver = dict(real, cloudpickle="0.0.1")  # the driver claims another cloudpickle than the executors run
    monkeypatch.setattr(versions, "collect", lambda: driver)
    with pytest.raises(sparktrain.RankFailedError) as e:
        sparktrain.run(lambda: 1, num_proc=3, max_attempts=3, verbose=0)
    root = e.value.root_cause
    assert root.exc_type == "sparktrain.errors.VersionMismatchError"
    assert f"cloudpickle: driver 0.0.1, this executor {real['cloudpickle']}" in root.message
    assert "Install the same versions on the executors" in root.message
    assert e.value.attempts == 1  # a mismatch would recur: not retried


SSL_SCRIPT = """
import os, sys
from pyspark.sql import SparkSession
import sparktrain

spark = (SparkSession.builder.master("local[2]").config("spark.ssl.enabled", "true")
         .config("spark.ui.enabled", "false").getOrCreate())
print("ENCRYPTED:", sparktrain.run(lambda: os.environ["SPARKTRAIN_ENCRYPTION"], num_proc=2, verbose=0))
try:
    sparktrain.run(lambda: 1, num_proc=2, verbose=0, encryption="off")
    print("NOT REFUSED")
except sparktrain.ClusterConfigError as e:
    print("REFUSED:", e)
os.environ["SPARKTRAIN_ALLOW_UNENCRYPTED"] = "true"
print("OVERRIDDEN:", sparktrain.run(lambda: sparktrain.rank() + 41, num_proc=2, verbose=0, encryption="off"))
"""


def test_ssl_turns_encryption_on_and_off_is_refused_unless_overridden_in_a_real_session(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "ssl_session.py"
    script.write_text(SSL_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "SPARKTRAIN_ALLOW_UNENCRYPTED"}
    env["PYSPARK_PYTHON"] = sys.executable
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ENCRYPTED: on" in proc.stdout, proc.stdout  # auto follows spark.ssl.enabled; the channel is encrypted
    assert "REFUSED: spark.ssl.enabled=true" in proc.stdout, proc.stdout
    assert "spark.sparktrain.allowUnencrypted=true" in proc.stdout
    assert "OVERRIDDEN: 41" in proc.stdout
