"""The screenshots of docs/observability.md's `miles view` section: a step page and a sample's detail of a ReTool run.

    python scripts/viewer_screenshots.py [RUN_DIR] [--out docs/images]

Without RUN_DIR, trains configs/retool.yaml for 3 steps into a temporary directory first (about 3 minutes on 2
CPU cores). Needs Chromium and its driver (apt-get install chromium chromium-driver) and selenium
(pip install -e '.[test]'). The PNGs are reduced to 128 colours, as the other images of the docs.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


def _train(run_dir: Path) -> None:
    subprocess.run([sys.executable, "-m", "miles", "train", "configs/retool.yaml", f"run.dir={run_dir}", "run.steps=3",
                    "run.eval_size=0", "run.progress=false"], cwd=ROOT, check=True)


def _reduce(path: Path) -> None:
    Image.open(path).convert("RGB").quantize(128).save(path, optimize=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", nargs="?", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = parser.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="miles-viewer-")) / "retool"
    if args.run_dir is None:
        _train(run_dir)
    last = max(int(p.name[5:11]) for p in (run_dir / "trajectories").glob("step_*.jsonl"))
    records = [json.loads(line) for line in (run_dir / f"trajectories/step_{last:06d}.jsonl").read_text().splitlines()]
    # a sample that called the tool and was right: policy tokens, the tool's output, the answer
    position = max(range(len(records)), key=lambda i: (bool(records[i]["tool_calls"]), records[i]["reward"] or 0))

    server = subprocess.Popen([sys.executable, "-m", "miles", "view", str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in [*FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='miles-chromium-')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    try:
        url = re.search(r"http://\S+", server.stdout.readline())[0]
        driver.set_window_size(1100, 760)
        driver.get(f"{url}step_{last:06d}.html")
        args.out.mkdir(parents=True, exist_ok=True)
        step_png, sample_png = args.out / "viewer_step.png", args.out / "viewer_sample.png"
        driver.save_screenshot(str(step_png))
        driver.set_window_size(1100, 2400)
        driver.find_element(By.CSS_SELECTOR, f"#samples tr[data-position='{position}']").click()
        time.sleep(0.5)
        driver.find_element(By.ID, "detail").screenshot(str(sample_png))
        for path in (step_png, sample_png):
            _reduce(path)
            print(f"wrote {path}")
    finally:
        driver.quit()
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
