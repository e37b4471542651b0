"""`python -m fpdoctor`."""

import sys

from fpdoctor.cli.main import main

sys.exit(main())
