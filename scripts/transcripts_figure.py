"""The transcripts page of a run (`python -m flexmarl_hpc.analyze RUN --transcripts --html`)
rendered by headless Chromium (Debian's `chromium`, scripts/setup_chromium.sh): a PNG
screenshot and the rendered DOM, in one launch. tests/e2e/test_episodes_e2e.py checks a real
run's page with it; `main` makes the docs' figure:

    python scripts/transcripts_figure.py RUN.h5 docs/transcripts_page.png [--step 0] [--worst 1]
                                         [--agent A] [--size 1000x1300]
    python scripts/transcripts_figure.py --tiny-run docs/transcripts_page.png   # the docs figure

`--tiny-run` first trains one step of configs/math_team.yaml on a tiny random chat model
(scripts/make_tiny_chat_model.py; data from scripts/make_math_team_data.py) in a temporary
folder: the real math_team episode (planner, solvers with the structured calculator,
verifier), its replies noise. No network: Chromium gets the page as a file:// URL and the
flags below keep it from calling home.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")
"""--no-sandbox: CI runs as root, where Chromium's own sandbox refuses to start; the page is
our own file, with no script."""


def chromium() -> str | None:
    """The Chromium executable, or None."""
    return shutil.which("chromium")


def render(page: Path, png: Path, size: tuple[int, int] = (1000, 1300), timeout: float = 120) -> str:
    """Screenshot `page` (an HTML file) into `png` at `size` (width, height) and return its
    DOM as Chromium rendered it; RuntimeError with Chromium's last output when it fails."""
    exe = chromium()
    if exe is None:
        raise RuntimeError("chromium not found (bash scripts/setup_chromium.sh installs it)")
    png = Path(png).resolve()
    png.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:   # a new, empty profile
        p = subprocess.run([exe, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                            f"--screenshot={png}", "--dump-dom", Path(page).resolve().as_uri()],
                           capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium exited {p.returncode} without {png}: {p.stderr[-1500:]}")
    return p.stdout


def tiny_run(folder: Path) -> Path:
    """One step of math_team on a tiny random chat model, into `folder`; returns its store."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_chat_model import make
    model = make(folder / "tiny-chat", hidden=32, layers=2, max_seq_len=2048)
    subprocess.run([sys.executable, str(ROOT / "scripts/make_math_team_data.py"), "--train", "20", "--eval", "4",
                    "--out", str(folder / "data")], check=True, capture_output=True, timeout=120)
    out = folder / "run"
    subprocess.run([sys.executable, "-m", "flexmarl_hpc.run", str(ROOT / "configs/math_team.yaml"),
                    f"run.output_dir={out}", "run.name=math_team", "run.steps=1", f"model.checkpoint={model}",
                    f"workflow.dataset.train={folder / 'data/train.jsonl'}", "workflow.dataset.eval=",
                    "workflow.inputs_per_step=2", "workflow.group_size=2", "workflow.max_new_tokens=24",
                    "rollout.max_model_len=2048"],
                   cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, capture_output=True,
                   timeout=600)
    return out / "math_team.h5"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", nargs="?", type=Path, help="the run's store (RUN.h5); not with --tiny-run")
    ap.add_argument("png", type=Path)
    ap.add_argument("--tiny-run", action="store_true", help="train one step of math_team on a tiny model first")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--worst", type=int, default=1)
    ap.add_argument("--agent", default=None)
    ap.add_argument("--size", default="1000x1300", help="WIDTHxHEIGHT of the screenshot, in pixels")
    a = ap.parse_args(argv)
    if (a.run is None) == (not a.tiny_run):
        ap.error("give RUN.h5 or --tiny-run")
    width, height = map(int, a.size.split("x"))
    from flexmarl_hpc.analyze import main as analyze
    with tempfile.TemporaryDirectory(prefix="transcripts-") as tmp:
        run = tiny_run(Path(tmp)) if a.tiny_run else a.run
        page = Path(tmp) / "transcripts.html"
        args = [str(run), "--transcripts", "--step", str(a.step), "--worst", str(a.worst), "--html", str(page)]
        rc = analyze(args + (["--agent", a.agent] if a.agent else []))
        if rc != 0:
            return rc
        render(page, a.png, (width, height))
    print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
