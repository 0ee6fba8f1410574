"""`python -m gapserve ...` is the `gapserve` console script."""

import sys

from gapserve.cli import main

sys.exit(main())
