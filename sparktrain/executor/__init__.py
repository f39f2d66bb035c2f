"""The executor side of a run: what a Spark executor does for one rank.

``task`` (the barrier task: rendezvous, env, output, result) -> ``supervisor`` (the rank process's
lifecycle) -> ``child`` (``python -m sparktrain.executor.child``, which calls ``train_fn``). It never
imports ``sparktrain.driver``.
"""
