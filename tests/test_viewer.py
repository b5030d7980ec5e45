"""The trajectory viewer, as a user meets it: real runs made with ``miles train`` (multi-turn with tool calls, and a
vision-language one whose pictures are files and data URLs), ``miles view`` started as a process of its own, and a
headless Chromium clicking through its pages, and through the static copy ``miles report`` writes, from disk."""

import base64
import json
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_miles

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1200,1400"]


def records(run_dir, step):
    path = run_dir / "trajectories" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def steps_of(run_dir):
    return sorted(int(p.name[5:11]) for p in (run_dir / "trajectories").glob("step_*.jsonl"))


def train(run_dir, *args):
    result = run_miles("train", *args, f"run.dir={run_dir}", "run.eval_size=0", "run.progress=false")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def retool_run(tmp_path_factory):
    """Multi-turn: code the model writes, the sandbox's output as observation tokens (loss mask 0)."""
    return train(tmp_path_factory.mktemp("viewer") / "retool", "configs/retool.yaml", "sft.steps=40",
                 "data.generator.direct_fraction=0.0", "run.steps=3", "rollout.prompts_per_step=4",
                 "rollout.n_samples=4")


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    """The dots pictures, every other one as a PNG file (the engine is sent its absolute path), the others as data
    URLs."""
    from miles.builtin.dots import dots

    data = tmp_path_factory.mktemp("dots")
    (data / "images").mkdir()
    rows = dots(seed=0, size=40)["train"]
    for i, row in enumerate(rows[::2]):
        part = row["prompt"][0]["content"][0]
        (data / f"images/{i:03d}.png").write_bytes(base64.b64decode(part["image"].partition(",")[2]))
        part["image"] = f"images/{i:03d}.png"
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return train(tmp_path_factory.mktemp("viewer") / "vlm", "configs/vlm.yaml", "data.generator=null",
                 f"data.train_path={data / 'train.jsonl'}", "sft.steps=2", "run.steps=3",
                 "rollout.prompts_per_step=2", "rollout.n_samples=2")


@contextmanager
def viewing(run_dir, *extra):
    """``miles view RUN_DIR`` in a process of its own; yields the URL it prints."""
    process = subprocess.Popen([sys.executable, "-m", "miles", "view", str(run_dir), *extra], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([process.stdout], [], [], 60)
        line = process.stdout.readline() if ready else ""
        match = re.search(r"http://\S+", line)
        assert match, (line, process.poll(), process.stderr.read() if process.poll() is not None else "")
        yield match[0]
    finally:
        process.terminate()
        process.wait(timeout=30)


def fetch(url, host=None):
    """(status, content type, body) of a GET."""
    request = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.skip("needs Chromium and its driver: apt-get install chromium chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install -e '.[test]')")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="miles-chromium-")
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver, css, timeout_s=20):
    """The elements matching ``css`` once there is one."""
    from selenium.webdriver.common.by import By

    wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, css), f"no {css!r} in {driver.current_url}", timeout_s)
    return driver.find_elements(By.CSS_SELECTOR, css)


def wait_until(condition, what, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def shown_rows(driver):
    """The sample list as shown: (group, index, reward, status, response tokens) per row."""
    cells = driver.execute_script("return [...document.querySelectorAll('#samples tbody tr')]"
                                  ".map(r => [...r.cells].map(c => c.textContent))")
    return [(int(c[0]), int(c[1]), c[2], c[3], int(c[6])) for c in cells]


def reward(record):
    value = record["reward"]
    return value["score"] if isinstance(value, dict) else value


def check_sample(driver, run_dir, step, position):
    """Open sample ``position`` of the step page shown and check its detail against the file."""
    from selenium.webdriver.common.by import By

    record = records(run_dir, step)[position]
    driver.find_element(By.CSS_SELECTOR, f"#samples tr[data-position='{position}']").click()
    wait_until(lambda: driver.current_url.endswith(f"#sample-{position}") and driver.execute_script(
        "const h = document.querySelector('#detail h2'); return h && h.textContent") ==
        f"Group {record['group']}, sample {record['index']}", f"sample {position}'s detail")
    classes = driver.execute_script("return [...document.querySelectorAll('#tokens span')].map(s => s.className)")
    assert len(classes) == len(record["tokens"])  # one span per token
    assert classes == ["tok pol" if m else "tok obs" for m in record["loss_mask"]]
    texts = driver.execute_script("return [...document.querySelectorAll('#tokens span')].map(s => s.textContent)")
    assert [t.replace("↵", "").replace("→", "") for t in texts] == [t or "∅" for t in record["tokens"]]
    shown = driver.find_element(By.ID, "d-advantage").text
    assert (shown == "—") if record["advantage"] is None else float(shown) == pytest.approx(record["advantage"],
                                                                                         rel=1e-3, abs=1e-12)
    assert driver.find_element(By.ID, "d-status").text == record["status"]
    assert driver.find_element(By.ID, "response-text").text == record["response_text"].strip()
    names = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#tool-calls .tool-name")]
    assert names == [call["name"] for call in record["tool_calls"]]
    errors = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#tool-calls .error")]
    assert errors == [f"error: {call['error']}" for call in record["tool_calls"] if call["error"]]
    return record


def test_served_viewer_shows_the_steps_filters_and_a_multi_turn_sample(retool_run, browser):
    from selenium.webdriver.common.by import By

    steps = steps_of(retool_run)
    assert steps == [0, 1, 2]
    with viewing(retool_run) as url:
        browser.get(url)
        links = wait_for(browser, "a.step-link")
        assert [a.text for a in links] == [f"step {s}" for s in steps]
        for cell, step in zip(browser.find_elements(By.CSS_SELECTOR, "td.mean-reward"), steps):
            rewards = [reward(r) for r in records(retool_run, step) if reward(r) is not None]
            assert float(cell.text) == pytest.approx(sum(rewards) / len(rewards), rel=1e-3, abs=1e-9)
        links[-1].click()
        wait_for(browser, "#samples tbody tr")
        assert browser.current_url == url + "step_000002.html"
        shown = records(retool_run, 2)
        assert [(g, i) for g, i, *_ in shown_rows(browser)] == [(r["group"], r["index"]) for r in shown]
        assert browser.find_element(By.ID, "count").text == f"{len(shown)} of {len(shown)} samples"

        # response length filter: the rows are those of the file whose response is at least that long
        lengths = sorted(len(r["tokens"]) for r in shown)
        bound = lengths[len(lengths) // 2]
        browser.find_element(By.ID, "f-len-min").send_keys(str(bound))
        expected = [(r["group"], r["index"]) for r in shown if len(r["tokens"]) >= bound]
        assert 0 < len(expected) < len(shown) or len(set(lengths)) == 1
        assert [(g, i) for g, i, *_ in shown_rows(browser)] == expected
        assert browser.find_element(By.ID, "count").text == f"{len(expected)} of {len(shown)} samples"
        browser.refresh()  # the filters are the page's, not kept
        wait_for(browser, "#samples tbody tr")
        assert len(shown_rows(browser)) == len(shown)

        # a trajectory that called the tool and got its output (which step has one depends on the sampling: a
        # call in a turn cut by the token limit gets no observation): observation tokens look unlike the policy's
        step, position = next((step, i) for step in steps for i, r in enumerate(records(retool_run, step))
                              if r["tool_calls"] and 0 in r["loss_mask"])
        browser.get(url + f"step_{step:06d}.html")
        wait_for(browser, "#samples tbody tr")
        record = check_sample(browser, retool_run, step, position)
        assert record["tool_calls"] and 0 in record["loss_mask"] and 1 in record["loss_mask"]
        assert "#sample-" in browser.current_url
        backgrounds = browser.execute_script(
            "return ['pol', 'obs'].map(k => getComputedStyle(document.querySelector('#tokens .' + k)).backgroundColor)")
        assert backgrounds[0] != backgrounds[1]
        assert browser.find_element(By.CSS_SELECTOR, ".legend-mask").is_displayed()
        arguments = browser.find_element(By.CSS_SELECTOR, "#tool-calls .arguments").text
        assert json.loads(arguments) == record["tool_calls"][0]["arguments"]

        # the mismatch view: each policy token coloured by its |train - rollout| gap, with the scale shown
        first = record["loss_mask"].index(1)
        title = browser.find_elements(By.CSS_SELECTOR, "#tokens span")[first].get_attribute("title")
        said = dict(line.split(": ", 1) for line in title.splitlines()[1:] if ": " in line)
        assert float(said["rollout log-prob"]) == pytest.approx(record["rollout_logprobs"][first], rel=1e-3)
        assert float(said["train log-prob"]) == pytest.approx(record["train_logprobs"][first], rel=1e-3)
        assert float(said["advantage"]) == pytest.approx(record["advantages"][first], rel=1e-3, abs=1e-12)
        browser.find_element(By.ID, "view-gap").click()
        assert browser.find_element(By.CSS_SELECTOR, ".legend-gap").is_displayed()
        assert not browser.find_element(By.CSS_SELECTOR, ".legend-mask").is_displayed()
        gaps = browser.execute_script("return [...document.querySelectorAll('#tokens span')].map(s => s.dataset.gap)")
        expected_gaps = [abs(t - r) if m else None for m, t, r in
                         zip(record["loss_mask"], record["train_logprobs"], record["rollout_logprobs"])]
        assert [float(g) if g is not None else None for g in gaps] == pytest.approx(expected_gaps, abs=1e-9)


def test_served_viewer_shows_images_and_gives_out_only_the_run_s_files(vlm_run, browser):
    from selenium.webdriver.common.by import By

    named = {ref for step in steps_of(vlm_run) for r in records(vlm_run, step) for ref in r["images"]}
    files = {ref for ref in named if not ref.startswith("data:")}
    assert files and len(files) < len(named)  # both kinds shown
    with viewing(vlm_run) as url:
        for step in steps_of(vlm_run):
            browser.get(url + f"step_{step:06d}.html")
            wait_for(browser, "#samples tbody tr")
            for position, record in enumerate(records(vlm_run, step)):
                check_sample(browser, vlm_run, step, position)
                images = browser.find_elements(By.CSS_SELECTOR, "#images img")
                assert len(images) == len(record["images"]) == 1
                assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth",
                                              images[0]) == 56
                src = images[0].get_attribute("src")
                ref = record["images"][0]
                assert src == ref if ref.startswith("data:") else src.endswith(urllib.parse.quote(ref, safe=""))

        # the server gives out the image files the trajectories name, and nothing else
        some = sorted(files)[0]
        status, kind, body = fetch(url + "image?path=" + urllib.parse.quote(some, safe=""))
        assert (status, kind, body) == (200, "image/png", Path(some).read_bytes())
        unnamed = next(p for p in sorted(Path(some).parent.glob("*.png")) if str(p) not in files)
        for path in [str(unnamed), "/etc/passwd", str(vlm_run / "config.yaml"), some + "/../" + unnamed.name,
                     f"{Path(some).parent}/./{Path(some).name}", ""]:
            assert fetch(url + "image?path=" + urllib.parse.quote(path, safe=""))[0] == 404, path
        assert fetch(url + "config.yaml")[0] == 404
        assert fetch(url + "step_000099.html")[0] == 404
        assert fetch(url + "../config.yaml")[0] == 404
        assert fetch(url, host="attacker.example")[0] == 403  # a name rebound to 127.0.0.1 reads nothing


def test_a_run_still_being_written_shows_its_new_steps_on_reload(retool_run, tmp_path, browser):
    from selenium.webdriver.common.by import By

    (tmp_path / "trajectories").mkdir()
    shutil.copy(retool_run / "trajectories/step_000000.jsonl", tmp_path / "trajectories")
    with viewing(tmp_path) as url:
        browser.get(url)
        assert [a.text for a in wait_for(browser, "a.step-link")] == ["step 0"]
        shutil.copy(retool_run / "trajectories/step_000001.jsonl", tmp_path / "trajectories")
        browser.refresh()
        assert [a.text for a in wait_for(browser, "a.step-link")] == ["step 0", "step 1"]
        browser.find_elements(By.CSS_SELECTOR, "a.step-link")[1].click()
        wait_for(browser, "#samples tbody tr")
        assert len(shown_rows(browser)) == len(records(retool_run, 1))


def test_report_writes_the_viewer_as_pages_that_open_from_disk(retool_run, vlm_run, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    result = run_miles("report", str(retool_run))
    assert result.returncode == 0, result.stderr[-3000:]
    report = retool_run / "report"
    viewer = report / "trajectories"
    assert sorted(p.name for p in viewer.glob("*.html")) == ["index.html"] + [f"step_{s:06d}.html" for s in range(3)]
    for page in viewer.glob("*.html"):  # self-contained: no script, style or anything else fetched
        text = page.read_text()
        assert not re.search(r"<(script|img|link)[^>]+(src|href)=", text), page
        assert "http://" not in text and "https://" not in text, page

    browser.get(report.joinpath("index.html").as_uri())
    section = browser.find_element(By.XPATH, "//h2[.='Sample completions']")
    assert section.is_displayed()
    assert [h.text for h in browser.find_elements(By.XPATH, "//h2[.='Sample completions']/following-sibling::h3")] \
        == ["Step 0", "Step 1", "Step 2"]
    completion = browser.find_element(By.CSS_SELECTOR, ".completion").text
    assert "reward" in completion and any(r["prompt"] in completion for r in records(retool_run, 0))
    browser.find_element(By.LINK_TEXT, "the trajectory viewer").click()
    links = wait_for(browser, "a.step-link")
    assert browser.current_url == viewer.joinpath("index.html").as_uri()
    links[1].click()
    wait_for(browser, "#samples tbody tr")
    shown = records(retool_run, 1)
    assert [(g, i) for g, i, *_ in shown_rows(browser)] == [(r["group"], r["index"]) for r in shown]
    position = max(range(len(shown)), key=lambda i: shown[i]["loss_mask"].count(0))
    check_sample(browser, retool_run, 1, position)
    browser.find_element(By.ID, "next").click()
    wait_for(browser, "#samples tbody tr")
    assert browser.current_url.endswith("step_000002.html")

    # the VLM run's pictures: files copied beside the pages, data URLs in them; the status filter
    assert run_miles("report", str(vlm_run)).returncode == 0
    copied = list((vlm_run / "report/trajectories/images").glob("*.png"))
    assert copied
    step = steps_of(vlm_run)[0]
    browser.get((vlm_run / f"report/trajectories/step_{step:06d}.html").as_uri())
    wait_for(browser, "#samples tbody tr")
    shown = records(vlm_run, step)
    for status in sorted({r["status"] for r in shown}):
        Select(browser.find_element(By.ID, "f-status")).select_by_value(status)
        assert [(g, i) for g, i, *_ in shown_rows(browser)] == \
            [(r["group"], r["index"]) for r in shown if r["status"] == status]
    Select(browser.find_element(By.ID, "f-status")).select_by_value("")
    best = max(reward(r) for r in shown)
    browser.find_element(By.ID, "f-reward-min").send_keys(str(best))
    assert [(g, i) for g, i, *_ in shown_rows(browser)] == \
        [(r["group"], r["index"]) for r in shown if reward(r) >= best]
    browser.refresh()
    wait_for(browser, "#samples tbody tr")
    for position in range(len(shown)):
        check_sample(browser, vlm_run, step, position)
        image = browser.find_element(By.CSS_SELECTOR, "#images img")
        assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 56


def test_view_refuses_what_is_not_a_run_with_trajectories(tmp_path):
    missing = run_miles("view", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr, missing.stderr
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    empty = run_miles("view", str(tmp_path))
    assert empty.returncode == 2, empty.stderr
    assert "holds no step_*.jsonl" in empty.stderr and "run.trajectories" in empty.stderr
    assert "Traceback" not in missing.stderr + empty.stderr
