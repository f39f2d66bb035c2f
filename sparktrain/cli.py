"""The ``sparktrain`` command. ``sparktrain demo`` runs a real 3-rank job on an embedded local Spark."""
from __future__ import annotations

import argparse
import sys


def demo_train(n_samples: int, epochs: int, lr: float) -> bytes | None:
    """Each rank fits a linear model by gradient descent on its own shard of a synthetic data set."""
    import io

    import numpy as np

    import sparktrain

    rank, size = sparktrain.rank(), sparktrain.size()
    rng = np.random.default_rng(0)  # every rank draws the same data set, then keeps its shard
    x = rng.normal(size=(n_samples, 4))
    true_w = np.array([1.5, -2.0, 0.5, 3.0])
    y = x @ true_w + rng.normal(scale=0.1, size=n_samples)
    x, y = x[rank::size], y[rank::size]
    w = np.zeros(4)
    for epoch in range(1, epochs + 1):
        grad = 2 * x.T @ (x @ w - y) / len(y)
        w -= lr * grad
        if epoch % max(1, epochs // 4) == 0 or epoch == epochs:
            loss = float(np.mean((x @ w - y) ** 2))
            print(f"epoch {epoch}/{epochs}: {len(y)} samples, loss {loss:.4f}")
    if not sparktrain.is_chief():
        return None
    buf = io.BytesIO()
    np.save(buf, w)
    return buf.getvalue()  # rank 0's "checkpoint"


def _demo(args: argparse.Namespace) -> int:
    import io
    import time

    import numpy as np

    import sparktrain

    started = time.monotonic()
    ckpt = sparktrain.run(demo_train, args=(args.samples, args.epochs, 0.1), num_proc=args.num_proc)
    w = np.load(io.BytesIO(ckpt))
    print(f"rank 0 returned a {len(ckpt)}-byte checkpoint in {time.monotonic() - started:.1f} s; "
          f"weights {np.round(w, 2).tolist()} (true [1.5, -2.0, 0.5, 3.0])")
    return 0 if np.allclose(w, [1.5, -2.0, 0.5, 3.0], atol=0.1) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparktrain", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a real 3-rank job on an embedded local Spark")
    demo.add_argument("--num-proc", type=int, default=3)
    demo.add_argument("--samples", type=int, default=3000)
    demo.add_argument("--epochs", type=int, default=200)
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
