"""`python -m server.cli`: the moeflash command line (the bench and the tests start it this way)."""

from server.cli import main

raise SystemExit(main())
