"""The executor side of a run: what a Spark executor does for one rank.

``task`` (the barrier task's steps) uses ``rendezvous``, ``rankenv`` (the rank's environment,
built once), ``output`` and ``result``; ``supervisor`` runs the rank process (``child``: ``python
-m sparktrain.executor.child``, which calls ``train_fn``), and ``watcher`` removes what the rank
owns if the task dies. It never imports ``sparktrain.driver``.
"""
