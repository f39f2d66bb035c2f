"""What the user sees of a run: the ranks' lines and the run's status (``display``, with
``outputlimit``), rank 0's value and where ranks ran (``results``), and what a Spark error says
(``spark_errors``)."""
