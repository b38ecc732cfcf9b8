"""`python -m flexmarl_hpc.status` on a live local run (SWMR store being written), then on
the same run finished."""
import os
import re
import subprocess
import sys
import time

import h5py

from tests.conftest import ROOT
from tests.helpers import SMALL_ANY_STEPS as SMALL, status_cli


def test_status_of_a_live_then_finished_local_run(tmp_path, mpiexec):
    """While the run writes (SWMR) status shows a partial bar with an ETA; once it is over,
    the bar is full, the rewards are the store's last ones and the checkpoints are listed."""
    steps = 40
    args = [sys.executable, "-m", "flexmarl_hpc.run", "configs/local.yaml", f"run.output_dir={tmp_path}",
            *SMALL, f"run.steps={steps}"]
    p = subprocess.Popen(args, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    live = []
    try:
        while p.poll() is None:
            if (tmp_path / "config.yaml").exists():
                q = status_cli(str(tmp_path))
                assert q.returncode == 0, q.stderr
                m = re.search(r"\] (\d+)/40 .*ETA (\d+:\d\d:\d\d)", q.stdout)
                if m and 0 < int(m.group(1)) < steps:
                    live.append(q.stdout)
            time.sleep(1.0)
    finally:
        out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert live, "never saw the run in progress"
    print(live[-1])
    assert "speed " in live[-1] and "samples/s" in live[-1] and "reward speaker" in live[-1]

    q = status_cli(str(tmp_path), "--follow", "--interval", "0.2")       # over: returns at once
    assert q.returncode == 0, q.stderr
    print(q.stdout)
    assert re.search(r"\[#+\] 40/40 \(100%\).* done", q.stdout)
    with h5py.File(tmp_path / "local.h5", "r") as f:
        last = {a: float(f[f"steps/{a}"]["reward_mean"][-1]) for a in ("speaker", "listener")}
    assert f"reward speaker {last['speaker']:.3f}  listener {last['listener']:.3f}  (step 40)" in q.stdout
    assert "ckpt   listener v000040.pt" in q.stdout and "speaker v000040.pt" in q.stdout
    assert "slurm" not in q.stdout                     # a local run has no job
