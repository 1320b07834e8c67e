"""``python -m airflow_keyset_provider.cli``."""

import sys

from . import main

sys.exit(main())
