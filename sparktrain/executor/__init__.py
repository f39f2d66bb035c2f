"""The executor side of a run: what a Spark executor does for one rank.

``task`` (the barrier task: rendezvous, env, output, result) -> ``supervisor`` (the rank process's
lifecycle) -> ``child`` (``python -m sparktrain.executor.child``, which calls ``train_fn``);
``warm`` keeps a held rank process in each Spark Python worker for the next run. It never
imports ``sparktrain.driver``.
"""
