"""How a run is supervised: the pure core (``supervision``), one attempt carrying out its decisions
(``attempt``), the run's attempts at the size a policy gives (``attempts``, ``elastic``), the
channel's driver end (``server``, ``connections``), stall reports (``stalls``), Ctrl-C and
cancellation (``interrupts``), and a named run's home before and after (``resume``)."""
