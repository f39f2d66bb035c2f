"""The ``sparktrain`` command.

- ``sparktrain run train.py --num-proc 3 [-- script args]``: run a training script on every rank.
- ``sparktrain check``: can this Spark cluster run sparktrain? (see sparktrain.cli.check)
- ``sparktrain demo``: a Keras 3 CNN trained with 3 ranks on an embedded local Spark.
- ``sparktrain runs <elastic_url>``: the named runs there: state, last commit, lease (see sparktrain.cli.runs).
- ``sparktrain submit-file``: the file to give spark-submit, to run these commands in a submitted job.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from .. import settings
from ..errors import InvalidArgumentError, SparkTrainError

RUN_EXAMPLE = "sparktrain run train.py --num-proc 3 -- --epochs 5"


def _key_value(flag: str):
    def parse(text: str) -> tuple[str, str]:
        key, sep, value = text.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}; for example {flag} "
                                             + ("spark.task.cpus=4" if flag == "--conf" else "TF_CPP_MIN_LOG_LEVEL=2"))
        return key.strip(), value

    return parse


def _argument(parse: Callable[[str, Any], Any]) -> Callable[[str], Any]:
    """An argparse type from one of ``sparktrain.settings``' parsers: the same rule, the same message."""
    def convert(text: str):
        try:
            return parse("value", text)
        except InvalidArgumentError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None

    return convert


_seconds = _argument(settings.parse_seconds)


def _positive_int(text: str) -> int:
    if text.strip().startswith("-") and text.strip()[1:].isdigit():
        # Horovod's negative np means local processes; here that is its own flag.
        raise argparse.ArgumentTypeError(f"must be a positive number of ranks, got {text!r}; to start that many "
                                         f"processes on this machine without Spark use --local --num-proc {text[1:]}")
    return _argument(settings.parse_positive_int)(text)


def _ranks(text: str):
    if text == "all":
        return None
    try:
        ranks = [int(r) for r in text.split(",")]
    except ValueError:
        ranks = [-1]
    if any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"must be 'all' or ranks separated by commas such as 0 or 0,1, got {text!r}")
    return ranks


class UsageError(SparkTrainError):
    """A command-line option that cannot apply; printed with the fix, exit code 2."""


def _session(master: str | None, conf: list[tuple[str, str]], default_master: str, remote: str | None = None):
    """The SparkSession a command uses, and whether the command started it (and should stop it).

    With ``remote``, a Spark Connect session to that server. Under spark-submit, spark-submit has
    chosen the master and conf; in a notebook that calls ``main`` the running session is used;
    otherwise an embedded session starts on ``master``.
    """
    from ..driver import face as cluster

    if remote:
        if master:
            raise UsageError(f"--master {master} cannot apply with --remote {remote}: the Connect server chose "
                             "its master; drop one of them")
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.remote(remote)
        for key, value in conf:
            builder = builder.config(key, value)
        return builder.getOrCreate(), True  # stopping a Connect client ends its session, not the server

    running = cluster.active_session()
    # spark-submit hands its JVM to the Python it starts through this variable.
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    if running is not None or submitted:
        who = "spark-submit" if submitted else "the running SparkSession"
        if master:
            where = "pass --master to spark-submit instead" if submitted else "leave it out"
            raise UsageError(f"--master {master} cannot apply: {who} already chose the master; {where}")
        if running is not None:
            if conf:
                raise UsageError(f"--conf {conf[0][0]}={conf[0][1]} cannot change the running SparkSession; "
                                 "set it where that session is created, or leave it out")
            return running, False
        return cluster.start_session(None, conf), True
    return cluster.start_session(master or default_master, conf), True


def _run(args: argparse.Namespace, script_args: list[str]) -> int:
    import sparktrain

    from . import script
    from ..errors import SparkTrainError

    if args.local and args.num_proc is None:
        raise UsageError("--local needs --num-proc, the number of processes to start, for example --local --num-proc 2")
    if args.local and (args.master or args.conf or args.remote):
        raise UsageError("--local runs without Spark, so --master, --conf and --remote do not apply; drop them or "
                         "drop --local")
    path = os.path.abspath(args.script)
    try:
        source = script.load(args.script)
    except SparkTrainError as e:
        raise UsageError(str(e)) from None
    spark, owned = None, False
    try:
        if not args.local:
            # A session the command starts reports a failed rank once, below, not again per task.
            spark, owned = _session(args.master, args.conf, f"local[{args.num_proc or '*'}]", args.remote)
            if args.verbose:
                master = spark.conf.get("spark.master", "?")
                print(f"sparktrain run: {args.script} on Spark {spark.version}, master {master}", file=sys.stderr)
        sparktrain.run(script.run_script, args=(path, source, script_args), num_proc=args.num_proc,
                       local_mode=args.local, env=dict(args.env), use_gpu=args.gpu, start_timeout=args.start_timeout,
                       timeout=args.timeout, output_ranks=args.output_ranks,
                       prefix_output_with_timestamp=args.timestamps, verbose=args.verbose)
    except UsageError:
        raise
    except InvalidArgumentError as e:  # a bad --env, say: the same exit as other bad options
        raise UsageError(str(e)) from None
    except SparkTrainError as e:
        print(f"sparktrain run: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - Spark failing to start, say; one line, not a JVM stack
        from ..driver.face import spark_error_reason

        print(f"sparktrain run: {spark_error_reason(e)}", file=sys.stderr)
        return 1
    finally:
        if owned:
            spark.stop()
    return 0


def _check(args: argparse.Namespace) -> int:
    from . import check

    if args.master and "PYSPARK_GATEWAY_PORT" in os.environ:  # refused here, not reported as a failed check
        raise UsageError(f"--master {args.master} cannot apply: spark-submit already chose the master; "
                         "pass --master to spark-submit instead")
    default = f"local[{args.num_proc or '*'}]"
    return check.run_check(lambda: _session(args.master, args.conf, default, args.remote), num_proc=args.num_proc,
                           wait=args.wait, timeout=args.timeout, build=args.build)


def _demo(args: argparse.Namespace) -> int:
    import time

    import sparktrain

    from . import demo

    started = time.monotonic()
    model_bytes = sparktrain.run(demo.train, args=(args.epochs, 32, 0.001), num_proc=args.num_proc,
                                 output_ranks=[0])
    path = os.path.abspath(args.out)
    with open(path, "wb") as f:
        f.write(model_bytes)

    from ..host import tflog

    # The driver runs TensorFlow to evaluate: its start-up lines are filtered as a rank's are.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    with tflog.filtered_stderr(tflog.level_from_env()):
        import keras

        model = keras.models.load_model(path)
        _, (x_test, y_test) = demo.digits()
        accuracy = float(model.evaluate(x_test.reshape(-1, 8, 8, 1), y_test, verbose=0)[1])
    print(f"trained on {args.num_proc} ranks in {time.monotonic() - started:.0f} s; test accuracy {accuracy:.3f} "
          f"(evaluated on the driver); checkpoint: {path} ({len(model_bytes)} bytes)")
    return 0 if accuracy > 0.9 else 1


def submit_file() -> str:
    """The file spark-submit runs to start this command: ``spark-submit FILE run train.py ...``."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__main__.py")


def _spark_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", help="Spark master of the session sparktrain starts (default local[N]); "
                                    "under spark-submit, give it to spark-submit instead")
    p.add_argument("--conf", action="append", default=[], type=_key_value("--conf"), metavar="KEY=VALUE",
                   help="a Spark setting for that session; repeatable")
    p.add_argument("--remote", metavar="sc://HOST:PORT",
                   help="use a Spark Connect server instead of starting a session (needs pyspark[connect] or "
                        "pyspark-client)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparktrain", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Data-parallel TensorFlow and Keras 3 training on Spark.\n\n"
                    f"  {RUN_EXAMPLE}\n  sparktrain check --master spark://host:7077\n  sparktrain demo\n"
                    "  spark-submit --master yarn \"$(sparktrain submit-file)\" run train.py --num-proc 4")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,check,demo,runs,submit-file}")

    run = sub.add_parser("run", help="run a training script on every rank",
                         description="Run a training script on every rank, as `python train.py ARGS` would, under "
                                     "sparktrain's env contract. The script is read here and shipped to the "
                                     f"executors. Example: {RUN_EXAMPLE}")
    run.add_argument("script", help="the training script, a Python file")
    run.add_argument("--num-proc", type=_positive_int, help="number of ranks (default: every task slot)")
    run.add_argument("--local", action="store_true", help="start the ranks as processes on this machine, without Spark")
    _spark_options(run)
    run.add_argument("--env", action="append", default=[], type=_key_value("--env"), metavar="KEY=VALUE",
                     help="an environment variable for every rank; repeatable")
    run.add_argument("--gpu", action=argparse.BooleanOptionalAction, default=None,
                     help="one GPU per rank (default: when spark.task.resource.gpu.amount is set)")
    run.add_argument("--start-timeout", type=_seconds, metavar="SECONDS",
                     help="for every rank to start (default 600)")
    run.add_argument("--timeout", type=_seconds, metavar="SECONDS", help="for the whole run (default: no limit)")
    run.add_argument("--output-ranks", type=_ranks, default=None, metavar="RANKS",
                     help="whose output to show: all (default), or ranks such as 0 or 0,1")
    run.add_argument("--timestamps", action="store_true", help="put the time before each output line")
    run.add_argument("--verbose", type=int, choices=(0, 1, 2), default=1, help="0 warnings, 1 progress, 2 debug")

    check = sub.add_parser("check", help="check that a Spark cluster can run sparktrain",
                           description="Print the Spark master and version, task slots, GPUs, and the Python, "
                                       "TensorFlow and Keras versions on the driver and on every executor; exit 1 "
                                       "on a problem that would make `sparktrain run` fail.")
    _spark_options(check)
    check.add_argument("--num-proc", type=_positive_int, help="the number of ranks to check for (default: every slot)")
    check.add_argument("--wait", type=_seconds, default=30.0, metavar="SECONDS",
                       help="for executors to register (default 30)")
    check.add_argument("--timeout", type=_seconds, default=120.0, metavar="SECONDS",
                       help="for the probing barrier stage (default 120)")
    check.add_argument("--build", action="store_true",
                       help="also compile the TensorFlow kernels into the kernel cache on every executor's host "
                            "(SPARKTRAIN_CACHE_DIR, else ~/.cache/sparktrain) and the driver's, ahead of a run")

    demo = sub.add_parser("demo", help="train a Keras 3 CNN on digits with 3 ranks on an embedded local Spark")
    demo.add_argument("--num-proc", type=int, default=3)
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--out", default="sparktrain-demo-model.keras", help="where the checkpoint goes")

    runs = sub.add_parser("runs", help="list the named runs under an elastic_url: state, last commit, lease",
                          description="List the runs named with run_id= under an elastic_url: each one's state "
                                      "(running: a driver holds its lease; finished: its result is recorded; "
                                      "failed: neither), its last commit (epoch, batch, time) and its lease. "
                                      "The store's credentials come from its usual environment variables.")
    runs.add_argument("elastic_url", help="the elastic_url setting of the runs, e.g. abfss://c@acct.dfs.core.windows.net/runs")
    runs.add_argument("--json", action="store_true", help="print a JSON list instead of a table")

    sub.add_parser("submit-file", help="print the file to give spark-submit: "
                                       "spark-submit $(sparktrain submit-file) run train.py ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" belongs to the script of `sparktrain run`.
    script_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, script_args = argv[:at], argv[at + 1:]
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        hint = f"; put the script's own arguments after --, as in: {RUN_EXAMPLE}" if args.command == "run" else ""
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if script_args and args.command != "run":
        parser.error(f"only `sparktrain run` takes arguments after --, got: {' '.join(script_args)}")
    try:
        if args.command == "run":
            return _run(args, script_args)
        if args.command == "check":
            return _check(args)
        if args.command == "demo":
            return _demo(args)
        if args.command == "runs":
            from . import runs

            return runs.print_runs(args.elastic_url, args.json)
        print(submit_file())
        return 0
    except UsageError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
