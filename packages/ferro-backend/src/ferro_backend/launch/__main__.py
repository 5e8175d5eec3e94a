"""``python -m ferro_backend.launch``: the ``ferrorun`` command (:mod:`.ferrorun`)."""

import sys

from .ferrorun import main

sys.exit(main())
