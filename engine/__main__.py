"""`python -m engine serve ...` is `strata serve ...`."""

import sys

from engine.cli import main

sys.exit(main())
