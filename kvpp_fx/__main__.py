import sys

from kvpp_fx.cli import main

sys.exit(main())
