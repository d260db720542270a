"""`python -m hybridgate`: the `hybridgate` command."""

import sys

from hybridgate.cli import main

sys.exit(main())
