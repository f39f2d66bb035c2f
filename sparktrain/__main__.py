"""``python -m sparktrain``: see sparktrain.cli."""
import sys

from .cli import main

sys.exit(main())
