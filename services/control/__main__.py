import sys

from loramux_services.control.main import main

sys.exit(main())
