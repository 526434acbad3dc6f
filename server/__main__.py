"""`python -m lorad.server`: the same as `lorad serve`."""

import sys

from lorad.server import serve_main

sys.exit(serve_main(sys.argv[1:]))
