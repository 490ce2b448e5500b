import sys

from loramux_engine.server.main import main

sys.exit(main())
