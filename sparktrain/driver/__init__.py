"""The driver side of a run: what happens in the notebook or spark-submit process, in three stages.

``run`` (``sparktrain.run`` and ``sparktrain.run_elastic``, each a pipeline of the same steps) ->
``launch`` (what is launched: the arguments and settings, the cluster view, the ranks' spec, the
barrier stage) -> ``supervise`` (how it is supervised: the pure core, an attempt, the attempts and
their size policies, the channel's driver end) -> ``show`` (what the user sees: the ranks' lines,
the run's status, rank 0's value, Spark's errors). Each stage imports only those after it. The
driver never imports ``sparktrain.executor`` except where ``launch.jobs`` ships a rank's work.
"""
