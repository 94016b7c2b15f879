"""`python -m tools.cli`: the `specstream` command."""

import sys

from tools.cli import main

sys.exit(main())
