"""``python -m receipts`` runs the command line."""

import sys

from receipts.cli import main

sys.exit(main())
