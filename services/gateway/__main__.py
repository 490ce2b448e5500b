import sys

from loramux_services.gateway.main import main

sys.exit(main())
