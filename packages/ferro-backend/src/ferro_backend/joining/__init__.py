"""Joining a job from its environment: which launcher started this process (:mod:`.detect`),
the transport its topology allows and how its ranks meet (:mod:`.meet`, :mod:`.mpi_meet`:
written once, for :func:`~ferro_backend.init_from_env`, elastic jobs and ferro-torch alike),
and the public entry point with the logging set-up (:mod:`.env`). The ``ferrorun`` command
line that starts such jobs is :mod:`ferro_backend.launch`'s."""
