"""``python -m wasibox``: the same as the ``wasibox`` command."""

import sys

from ._cli import main

sys.exit(main())
