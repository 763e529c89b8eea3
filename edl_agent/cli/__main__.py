"""`python -m edl_agent.cli`, as the `edl-agent` script."""

import sys

from edl_agent.cli.command import main

sys.exit(main())
