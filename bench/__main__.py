"""`python -m bench ...`: the same as `cbserve bench ...`."""

import sys

from bench.serving import main

sys.exit(main())
