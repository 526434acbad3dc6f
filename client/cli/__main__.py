"""`python -m lorad.client.cli`: the lorad command line."""

import sys

from lorad.client.cli import main

sys.exit(main())
