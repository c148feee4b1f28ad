import sys

from adamps.cli import main

sys.exit(main())
