"""The driver side of a run: what happens in the notebook or spark-submit process.

``run`` and ``elastic`` (validate, pickle, settings) -> ``views`` (session, capacity) ->
``attempts`` (one loop for fixed and elastic runs) -> ``attempt`` (supervise one gang) with
``jobs`` (the barrier stage) and ``server`` (the channel's driver end). It never imports
``sparktrain.executor`` except where ``jobs`` ships a rank's work.
"""
