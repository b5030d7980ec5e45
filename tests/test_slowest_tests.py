"""scripts/slowest_tests.py reads the JUnit XML pytest writes: the times it reports are those the file holds."""

import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import slowest_tests  # noqa: E402


def test_the_slowest_tests_and_files_of_a_real_pytest_junit_file(tmp_path):
    (tmp_path / "test_a.py").write_text("def test_one():\n    pass\n\nclass TestGroup:\n    def test_two(self):\n"
                                        "        pass\n")
    (tmp_path / "test_b.py").write_text("def test_three():\n    pass\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
                    f"--junitxml={junit}", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
    recorded = {f"{c.get('classname')}::{c.get('name')}": float(c.get("time"))
                for c in ElementTree.parse(junit).iter("testcase")}
    assert len(recorded) == 3
    result = slowest_tests.summary(slowest_tests.durations(junit), top=2)
    assert result["tests"] == 3 and result["total_s"] == round(sum(recorded.values()), 1)
    assert [t for t, _ in result["slowest_tests"]] == sorted(recorded, key=lambda t: -recorded[t])[:2]
    files = {f for f, _ in result["slowest_files"]}
    assert files <= {"test_a", "test_b"} and len(files) == 2  # TestGroup counts to test_a's file


def test_a_missing_file_is_named_with_exit_code_2(tmp_path, capsys):
    assert slowest_tests.main([str(tmp_path / "none.xml")]) == 2
    assert "none.xml not found" in capsys.readouterr().err
