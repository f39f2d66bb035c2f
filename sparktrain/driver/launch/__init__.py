"""What a run launches, prepared into one ``Launch`` (``prepare``): its arguments checked and its
settings resolved once (``config``, with ``preflight`` and ``capacity``), the cluster as the driver
sees it (``views``, over ``cluster``, ``connect`` and ``probe``), the ranks' spec (``taskspec``), the
fed DataFrames (``feed``, ``scans``), and the barrier stage itself (``jobs``)."""
