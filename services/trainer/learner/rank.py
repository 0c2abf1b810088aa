"""A data-parallel rank other than 0: `python -m services.trainer.learner.rank`, started by rank
0 (`distributed.Leader`), never by hand. The first line of stdin says which rank it is and what
to build; `distributed.serve` then runs rank 0's steps until told to close."""

from __future__ import annotations

import json
import logging
import sys


def main() -> int:
    init = json.loads(sys.stdin.buffer.readline())
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank {init['rank']} %(levelname)s %(name)s: %(message)s")
    from services.trainer.learner.distributed import serve

    serve(init)
    return 0


if __name__ == "__main__":
    sys.exit(main())
