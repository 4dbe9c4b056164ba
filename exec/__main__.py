"""``python -m rrfp.exec`` is ``rrfp-run``.

So ``torchrun --standalone --nproc-per-node 2 -m rrfp.exec --check`` works: torchrun starts this module
in every worker, and the CLI joins the job.
"""

from rrfp.exec.cli import main

if __name__ == "__main__":
    main()
