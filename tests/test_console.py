"""The console of `eqgpt-train`: no JAX warnings or XLA C++ log lines by default, and a progress line every
--log-every steps when there is no progress bar (--no-progress, or stdout a file)."""

from __future__ import annotations

import re
import subprocess

import pytest

from recipe_runs import TINY, console_script, write_documents


@pytest.mark.slow
def test_a_run_logged_to_a_file_is_quiet_and_reports_every_log_every_steps(tmp_path):
    write_documents(tmp_path / "docs")
    args = [*TINY, "--steps", "6", "--log-every", "2", "--eval-every", "0", "--data.corpus", "docs",
            "--data.cache-dir", str(tmp_path / "cache"), "--out-dir", "run", "--no-compile-cache"]
    with open(tmp_path / "stdout.txt", "w") as out:
        proc = subprocess.run([*console_script("eqgpt-train"), *args], cwd=tmp_path, stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=600)
    printed = (tmp_path / "stdout.txt").read_text()
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = printed + proc.stderr
    assert "UserWarning" not in console and "donated buffers" not in console
    assert not [line for line in console.splitlines() if re.match(r"[IWEF]\d{4} ", line)]  # absl/XLA C++ logs
    steps = re.findall(r"^step (\d+)/6: loss [\d.]+(.*)$", printed, re.M)
    assert [int(s) for s, _ in steps] == [1, 2, 4, 6], printed
    for _, rest in steps[1:]:  # after the first step (which includes the compile): throughput, MFU, ETA
        assert re.fullmatch(r" \| [\d,]+ tok/s \| MFU [\d.]+% \| eta \d+m\d\ds", rest), rest
