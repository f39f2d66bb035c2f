"""The ``sparktrain`` command. ``sparktrain demo`` trains a Keras 3 CNN with 3 ranks on an embedded local Spark."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    import os
    import time

    import sparktrain

    from . import demo

    started = time.monotonic()
    model_bytes = sparktrain.run(demo.train, args=(args.epochs, 32, 0.001), num_proc=args.num_proc,
                                 env={"TF_CPP_MIN_LOG_LEVEL": "3"}, output_ranks=[0])
    path = os.path.abspath(args.out)
    with open(path, "wb") as f:
        f.write(model_bytes)

    import keras

    model = keras.models.load_model(path)
    _, (x_test, y_test) = demo.digits()
    accuracy = float(model.evaluate(x_test.reshape(-1, 8, 8, 1), y_test, verbose=0)[1])
    print(f"trained on {args.num_proc} ranks in {time.monotonic() - started:.0f} s; test accuracy {accuracy:.3f} "
          f"(evaluated on the driver); checkpoint: {path} ({len(model_bytes)} bytes)")
    return 0 if accuracy > 0.9 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparktrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a Keras 3 CNN on digits with 3 ranks on an embedded local Spark")
    demo.add_argument("--num-proc", type=int, default=3)
    demo.add_argument("--epochs", type=int, default=10)
    demo.add_argument("--out", default="sparktrain-demo-model.keras", help="where the checkpoint goes")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
