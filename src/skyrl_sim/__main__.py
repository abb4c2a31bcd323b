"""``python -m skyrl_sim``: the same command line as ``skyrl-sim``."""

import sys

from skyrl_sim.cli import main

sys.exit(main())
