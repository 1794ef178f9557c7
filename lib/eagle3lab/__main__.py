"""``python -m eagle3lab`` behaves like the ``eagle3lab`` console script."""

import sys

from eagle3lab.cli import main

sys.exit(main())
