"""`python -m shoal ...`."""

import sys

from shoal.api.cli import main

sys.exit(main())
