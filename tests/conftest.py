"""The test suite's rank pools are forked by a fork server that imported torch once (``RankPool``'s
``start_method``), so that each pool starts in a fraction of a second instead of some 2 s per rank; the tests of
``RankPool`` itself name the start method they test. Set ``UBEP_POOL_START_METHOD=spawn`` to run the suite with
spawned ranks."""
import os

os.environ.setdefault("UBEP_POOL_START_METHOD", "forkserver")
