"""The driver side of a run: what happens in the notebook or spark-submit process.

A run is ``supervise(prepare(arguments), policy)``: ``launch`` prepares what is launched (the
arguments and settings, the cluster view and its probes, the ranks' spec, the barrier stage) into
one ``Launch``; ``supervise`` runs it under a size policy (the pure core, an attempt, the one loop,
the channel's driver end) and imports nothing of ``launch``; ``show`` is what the user sees (the
ranks' lines, the run's status, rank 0's value, Spark's errors). ``run.py`` holds ``sparktrain.run``
and ``run_elastic``; ``face.py`` is what the driver's clients (tune, ml, the CLI, HorovodRunner)
import. The driver never imports ``sparktrain.executor`` except where ``launch.jobs`` ships a rank's work.
"""
