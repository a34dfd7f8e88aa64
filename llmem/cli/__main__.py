"""`python -m llmem.cli ...`: the `llmem` command."""

import sys

from llmem.cli import main

sys.exit(main())
