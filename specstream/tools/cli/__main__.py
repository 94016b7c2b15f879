"""`python -m specstream.tools.cli`: the `specstream` command."""

import sys

from specstream.tools.cli import main

sys.exit(main())
