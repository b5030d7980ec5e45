import sys

from miles.cli import main

sys.exit(main())
