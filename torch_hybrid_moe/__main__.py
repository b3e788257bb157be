"""`python -m torch_hybrid_moe` is the `hybrid-moe` command."""

import sys

from .cli import main

sys.exit(main())
