"""``python -m unbroken.checkpoint.save_helper FD PARENT_PID``: what SaveHelper starts."""

import sys

from unbroken.checkpoint.save_helper.service import serve

if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
