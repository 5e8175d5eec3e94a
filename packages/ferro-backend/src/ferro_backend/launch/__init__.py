"""Joining a job: which launcher started this process (:mod:`.detect`), the transport its
topology allows and how its ranks meet (:mod:`.join`, :mod:`.mpi_join`: written once, for
:func:`~ferro_backend.init_from_env` and ferro-torch alike), the public entry point and the
logging set-up (:mod:`.env`), and ``ferrorun`` itself (:mod:`.ferrorun`, :mod:`._rank_main`).
"""
