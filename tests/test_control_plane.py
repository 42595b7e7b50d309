"""The control plane at 64 simulated workers (benchmarks/job/control_plane.py): the real launcher
(driver, coordinator, HTTP server, rendezvous, event log) forms a generation of all 64, then a
scale-in and a scale-out, with every simulated worker speaking the protocol over HTTP from a
separate load-generator process.  Speed goals are the benchmark's, not asserted here."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_64_simulated_workers_form_scale_in_and_out(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "job" / "control_plane.py"), "--workers", "64",
         "--steady-s", "1", "--flood-s", "0.5", "--build-s", "0.2", "--timeout-s", "20",
         "--no-mesh", "--output", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:]
    (row,) = json.loads(out.read_text())["control_plane"]["rows"]
    assert "error" not in row, row
    assert row["event_kinds"] == ["start", "scale_in", "scale_out"], row["event_kinds"]
    sizes = [(s["kind"], s["size"], s["members"]) for s in row["switches"]]
    assert sizes == [("scale_in", 56, 56), ("scale_out", 64, 64)], sizes
    assert row["requests_per_s"] > 0 and row["launcher_rss_mb"] > 0
    # the long polls wait as futures: no thread per open poll (64 workers keep 64 open)
    assert row["steady_threads"] < 40, row["steady_threads"]
    assert "formation s" in proc.stdout  # the table
