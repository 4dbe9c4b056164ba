"""A reader that closes rrfp-run's stdout early (``rrfp-run ... | head -1``) is no fault of the job:
rank 0 must not take the broken pipe for a lost peer (it did: exit 3, "a collective failed")."""

from __future__ import annotations

from execkit import BIN, JOB_TIMEOUT, assert_no_leftovers, start_job, stop_job


def test_a_closed_stdout_pipe_ends_the_job_cleanly() -> None:
    args = ["--gpus", "2", "--synthetic", "--iterations", "1", "--no-progress"]
    proc = start_job([str(BIN / "rrfp-run"), *args])
    try:
        first = proc.stdout.readline()
        proc.stdout.close()  # like `head -1`: the rest of the table meets a closed pipe
        proc.wait(timeout=JOB_TIMEOUT)
        err = proc.stderr.read()
    except BaseException:
        stop_job(proc)
        raise
    assert_no_leftovers(proc.pid)
    assert first.startswith("rrfp-run: synthetic sleeps")
    assert proc.returncode == 0, err
    assert "collective failed" not in err and "Traceback" not in err
