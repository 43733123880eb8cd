"""`python -m jobsignal` runs the command line."""

import sys

from jobsignal.cli import main

sys.exit(main())
