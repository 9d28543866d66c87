import sys

from dsecctl.main import main

sys.exit(main())
