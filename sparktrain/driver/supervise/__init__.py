"""How a run is supervised: ``attempts.supervise(launch, policy)``, the one loop; the size policies
(``policies``), the pure core of one attempt (``supervision``) and the attempt carrying out its
decisions (``attempt``); an elastic run's I/O (``elastic``) and a named run's home before and after
(``resume``); the channel's driver end (``server``, ``connections``, ``ranklinks``), stall reports
(``stalls``), Ctrl-C and cancellation (``interrupts``)."""
