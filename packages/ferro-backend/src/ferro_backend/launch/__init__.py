"""``ferrorun`` (``python -m ferro_backend.launch``): the command line that starts a job's ranks
(:mod:`.ferrorun`, :mod:`._rank_main`), supervises them and their output (:mod:`.supervisor`,
:mod:`.output`), restarts an elastic job (:mod:`.elastic_run`, :mod:`.coordinator`) and
emulates several nodes on one host (:mod:`.emulate`, :mod:`.netns`). How a rank then joins
its job is :mod:`ferro_backend.joining`'s.
"""
