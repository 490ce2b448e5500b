import sys

from services.control.main import main

sys.exit(main())
