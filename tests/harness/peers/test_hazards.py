"""harness.peers.hazards: each bundle replays its hazard standalone (exit 1, both numbers
printed), with torch only."""

from __future__ import annotations

import subprocess
import sys

from harness.peers import hazards


def test_every_bundle_replays_its_hazard_from_its_own_folder(tmp_path):
    folders = hazards.write_bundles(tmp_path)
    assert [f.name for f in folders] == [h.name for h in hazards.HAZARDS]
    for folder in folders:
        assert "Why our engine" in (folder / "README.md").read_text()
        done = subprocess.run(
            [sys.executable, "repro.py"], cwd=folder, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 1, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        assert any("max diff 0" in line for line in lines), lines  # agrees where it should
        last = lines[-1]  # and differs (or fails) where it must
        assert "raises" in last or float(last.rsplit(" ", 1)[-1]) > 1e-5, lines


def test_the_command_writes_the_bundles_and_explains_its_usage(tmp_path, capsys):
    assert hazards.main([str(tmp_path)]) == 0
    assert (tmp_path / "tied-shared-block" / "repro.py").is_file()
    assert hazards.main([]) == 2
    assert "usage" in capsys.readouterr().err
