"""``python -m receipts`` runs the command line (see :mod:`receipts.console`)."""

import sys

from receipts.console import main

sys.exit(main())
