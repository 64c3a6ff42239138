"""`python -m cluster ...` is `orchard ...` (how `orchard up` starts its children with the
same interpreter)."""

import sys
from importlib import import_module

sys.exit(import_module(f"{__package__}.cli").main())
